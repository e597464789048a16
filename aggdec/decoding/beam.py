"""Batched beam search that reproduces fairseq 0.12's `SequenceGenerator` + `search.BeamSearch`.

Per step, for every active sentence (beam K, vocabulary V), exactly as fairseq does:
  - lprobs = log_softmax(logits) (in float32, or float64 for float64 models); NaN, pad -> -inf;
    at step >= max_len everything but eos is -inf; at step < min_len eos is -inf.
  - Step 0 uses only the first beam (all beams are equal); later steps add each beam's cumulative
    score. The 2K best of K*V (step 0: of V) are the candidates.
  - eos candidates among the first K candidates (not ignored, finite score) are finalized with the
    normalized score cumulative / (len ** lenpen), len counting the eos. A sentence is finished once
    it holds K finalized hypotheses, or at step == max_len; finished sentences leave the batch.
  - The K active hypotheses are the first K non-eos candidates (if fewer exist, eos candidates fill
    in and are marked "ignored", fairseq's `cands_to_ignore`, including its indexing quirk).
  - The result is the finalized hypothesis with the best normalized score (fairseq sorts the
    scores, converted to a float tensor, with torch.sort descending and takes the first); with
    `nbest` > 1 also the first `nbest` of that order (fairseq-generate's --nbest), each with its
    normalized score.

Differences from fairseq-generate, by design: each sentence has its own max_len (fairseq uses the
batch's padded source width, so the two agree at batch size 1), and sources are right-padded.
Beam reordering uses the model's cache: `cache.reorder(rows, ...)` picks the parent row of every beam
(copying only the decoded prefix, and the cross K/V only when sentences leave).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from aggdec.decoding.candidates import chunk_for, top_candidates
from aggdec.decoding.loop import EncodeAhead, LoopCounters, take
from aggdec.decoding.metadata import BeamHypothesis, Hypothesis, Request, RowStats
from aggdec.decoding.options import DecodeOptions, OptionError, option
from aggdec.decoding.pair_beam import pair_beam_search
from aggdec.model.cache import DecoderCache
from aggdec.model.transformer import Transformer


@dataclass(frozen=True, kw_only=True)
class BeamOptions(DecodeOptions):
    """Beam search as fairseq-generate --beam (not a draft -> verify method); over token pairs for a
    double-token model (aggdec.decoding.pair_beam)."""

    method: ClassVar[str] = "beam"

    beam: int = option(5, "Beam size.", low=1)
    lenpen: float = option(1.0, "Length penalty: hypotheses are ranked by sum of log-probs / len ** lenpen.")
    nbest: int = option(1, "Results also carry the nbest best hypotheses with their scores.", low=1)

    def validate(self) -> None:
        if self.nbest > self.beam:
            raise OptionError("nbest", f"must be <= beam ({self.beam}), got {self.nbest}")

    def run(self, model: Transformer, requests: list[Request], prompt: tuple[int, ...] | None = None) -> list[Hypothesis]:
        if model.cfg.double_token:  # beam over (head, tail) pairs, the double-token paper's Algorithm 1
            return pair_beam_search(model, requests, beam=self.beam, lenpen=self.lenpen,
                                    max_batch_size=self.max_batch_size, nbest=self.nbest, prompt=prompt)
        return beam_search(model, requests, beam=self.beam, lenpen=self.lenpen, max_batch_size=self.max_batch_size,
                           nbest=self.nbest, prompt=prompt)


@torch.no_grad()
def beam_search(model: Transformer, requests: list[Request], *, beam: int = 5, lenpen: float = 1.0,
                max_batch_size: int = 16, min_len: int = 1, nbest: int = 1,
                prompt: tuple[int, ...] | None = None) -> list[BeamHypothesis]:
    """Beam-search `requests` (each: source ids ending in eos, max_len); results in input order.

    At most `max_batch_size` sentences (each `beam` rows) are searched at once, longest sources
    first; a sentence that finishes leaves and the next one takes its rows (continuous batching:
    each sentence searches from its own step, exactly as alone). `stats.iterations` is the number of
    decoder calls a sentence took. Each result carries the best `nbest` (1 <= nbest <= beam)
    hypotheses with their scores. prompt: (decoder start token, forced first tokens...) as in
    DraftVerifyLoop; a forced token scores log-prob 0 (Hugging Face's convention).
    """
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest must be in [1, beam={beam}], got {nbest}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    for r in requests:
        if r.max_len < min_len:
            raise ValueError(f"request {r.index}: max_len={r.max_len} is below min_len={min_len} "
                             "(fairseq: 'min_len cannot be larger than max_len')")
        if not r.src:
            raise ValueError(f"request {r.index}: empty source (it must at least hold eos)")
    if not requests:
        return []
    own = [replace(r) for r in requests]  # one object per position (encode-ahead keys requests by identity)
    position = {id(r): i for i, r in enumerate(own)}
    queue = sorted(own, key=lambda r: len(r.src))  # admitted from the end: longest first
    results: dict[int, BeamHypothesis] = {}
    for req, hyp in _search(model, queue, beam, lenpen, min_len, nbest, prompt or (model.cfg.eos,), max_batch_size):
        results[position[id(req)]] = hyp
    return [results[i] for i in range(len(requests))]


def _search(model: Transformer, queue: list[Request], beam: int, lenpen: float, min_len: int, nbest: int,
            prompt: tuple[int, ...], max_batch_size: int):
    """Yield (request, BeamHypothesis) as sentences finish, admitting the queue's (popped from its end)
    into free rows; each sentence's search mirrors SequenceGenerator._generate from its own step."""
    cfg = model.cfg
    pad, eos = cfg.pad, cfg.eos
    vocab = cfg.tgt_vocab
    k = min(beam, vocab - 1)  # fairseq: the max beam size is the dictionary size - 1 (pad is never chosen)
    device = next(model.parameters()).device
    width = max(r.max_len for r in queue) + 2  # token columns: the start token, max_len tokens, eos
    forced = prompt[1:]
    cand_size = 2 * k
    cand_offsets = torch.arange(cand_size, device=device)
    chunk = chunk_for(vocab)
    neg = -math.inf
    ahead = EncodeAhead(model, None, LoopCounters(), max_batch_size)

    # per sentence in the batch (host): its request, step (= decoder calls so far), max_len, results so far
    reqs: list[Request] = []
    steps: list[int] = []
    max_host: list[int] = []
    finalized: list[list[tuple[list[int], float]]] = []
    ms: list[float] = []
    # per sentence / row (device)
    step_t = torch.zeros(0, dtype=torch.long, device=device)  # (bsz,)
    sent_max = torch.zeros(0, dtype=torch.long, device=device)  # (bsz,)
    cands_to_ignore = torch.zeros(0, k, dtype=torch.bool, device=device)  # (bsz, k)
    tokens = torch.full((0, width), pad, dtype=torch.long, device=device)  # (bsz*k, width)
    cum: torch.Tensor | None = None  # (bsz*k,) cumulative scores, dtype of lprobs
    cache = None

    def admit(new: list[Request]) -> None:
        nonlocal cache, step_t, sent_max, cands_to_ignore, tokens

        def put(at: list[int], cross) -> None:
            nonlocal cache
            if cache is None:
                longest = max(r.max_len for r in queue + new)
                cache = DecoderCache(cross, cfg.dec_layers, cfg.d_model, capacity=min(longest + 1, 64), group=k,
                                     indirect=True)
            else:
                cache.admit(cross)
            placed.extend(new[i] for i in at)

        placed: list[Request] = []
        ahead.place(new, queue, put)
        m = len(placed)
        reqs.extend(placed)
        steps.extend([0] * m)
        max_host.extend(r.max_len for r in placed)
        finalized.extend([] for _ in range(m))
        ms.extend([0.0] * m)
        step_t = torch.cat([step_t, step_t.new_zeros(m)])
        sent_max = torch.cat([sent_max, torch.tensor([r.max_len for r in placed], dtype=torch.long, device=device)])
        cands_to_ignore = torch.cat([cands_to_ignore, cands_to_ignore.new_zeros(m, k)])
        fresh = tokens.new_full((m * k, width), pad)
        fresh[:, 0] = prompt[0]
        tokens = torch.cat([tokens, fresh])

    while True:
        if queue and len(reqs) < max_batch_size:
            before = len(reqs)
            admit(take(queue, max_batch_size - len(reqs), 0, None))
            # all beams start equal: a new sentence expands its first beam only (fairseq's step 0)
            start = torch.full((len(reqs) - before, k), neg, device=device)
            start[:, 0] = 0.0
            cum = start.view(-1) if cum is None else torch.cat([cum, start.view(-1).to(cum.dtype)])
        bsz = len(reqs)
        if bsz == 0:
            return
        t0 = time.perf_counter()
        n = bsz * k
        step_rows = step_t.repeat_interleave(k)  # (n,)
        logits = model.decode(tokens.gather(1, step_rows[:, None]), cache)[:, 0]  # (n, V)
        cache.commit(1)
        lp_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        lprobs = torch.log_softmax(logits.to(lp_dtype), dim=-1)
        cum = cum.to(lp_dtype)

        lprobs.nan_to_num_(nan=neg, posinf=math.inf, neginf=neg)  # NaN -> -inf in one pass
        lprobs[:, pad] = neg
        at_max = any(s >= m for s, m in zip(steps, max_host))
        if at_max:  # some sentence at its max_len: eos only
            force = (step_t >= sent_max).repeat_interleave(k)  # (n,)
            lprobs[force, :eos] = neg
            lprobs[force, eos + 1:] = neg
        if min(steps) < min_len:
            lprobs[(step_rows < min_len), eos] = neg
        if forced and min(steps) < len(forced):
            for b, s in enumerate(steps):
                if s < len(forced):
                    lprobs[b * k: (b + 1) * k] = neg
                    lprobs[b * k: (b + 1) * k, forced[s]] = 0.0

        # search.BeamSearch.step; a new sentence's beams but the first score -inf (fairseq: step 0
        # takes the first beam's candidates only)
        lp = lprobs.view(bsz, k, vocab).add_(cum.view(bsz, k, 1))  # lprobs is not read again
        flat = lp.view(bsz, -1)
        cand_scores, cand_flat = top_candidates(flat, min(cand_size, flat.size(1) - 1), chunk)
        cand_beams = torch.div(cand_flat, vocab, rounding_mode="trunc")
        cand_indices = cand_flat.fmod(vocab)
        bbsz_offsets = (torch.arange(bsz, device=device) * k).unsqueeze(1)
        cand_bbsz_idx = cand_beams + bbsz_offsets

        eos_mask = cand_indices.eq(eos) & cand_scores.ne(neg)
        # fairseq's quirk: a beam-indexed mask on candidate positions
        eos_mask[:, :k].masked_fill_(cands_to_ignore, False)
        eos_bbsz_idx = torch.masked_select(cand_bbsz_idx[:, :k], mask=eos_mask[:, :k])

        newly: list[int] = []
        if eos_bbsz_idx.numel() > 0:
            eos_scores = torch.masked_select(cand_scores[:, :k], mask=eos_mask[:, :k])
            newly = _finalize(steps, eos_bbsz_idx, eos_scores, tokens, k, lenpen, eos, finalized, max_host)
        # A sentence at its max_len always gets an eos finalized above; this guards the impossible.
        if at_max:
            newly += [b for b in range(bsz) if steps[b] >= max_host[b] and b not in newly]

        elapsed = 1000.0 * (time.perf_counter() - t0) / bsz
        for b in range(bsz):
            ms[b] += elapsed
        for b in sorted(newly):
            yield reqs[b], _best(reqs[b], finalized[b], tokens, cum, b, k, steps[b], eos, pad, steps[b] + 1, ms[b],
                                 lenpen, nbest)

        old_cand_bbsz_idx = cand_bbsz_idx  # rows of the cache before sentences leave
        if newly:
            gone = set(newly)
            keep = [b for b in range(bsz) if b not in gone]
            batch_idxs = torch.tensor(keep, dtype=torch.long, device=device)
            new_bsz = len(keep)
            eos_mask = eos_mask[batch_idxs]
            cand_beams = cand_beams[batch_idxs]
            old_cand_bbsz_idx = cand_bbsz_idx[batch_idxs]
            cand_bbsz_idx = cand_beams + (torch.arange(new_bsz, device=device) * k).unsqueeze(1)
            cand_scores = cand_scores[batch_idxs]
            cand_indices = cand_indices[batch_idxs]
            cands_to_ignore = cands_to_ignore[batch_idxs]
            step_t, sent_max = step_t[batch_idxs], sent_max[batch_idxs]
            for lst in (reqs, steps, max_host, finalized, ms):
                lst[:] = [lst[b] for b in keep]
            bsz = new_bsz
        steps[:] = [s + 1 for s in steps]
        step_t = step_t + 1
        if bsz == 0:  # every sentence finished: the queue's next ones take all rows
            tokens, cum = tokens[:0], cum[:0]
            cache.reorder(old_cand_bbsz_idx.view(-1), 0, take_cross=True)
            continue

        # Active hypotheses: the first k candidates that are not (unignored) eos.
        eos_mask[:, :k] = ~((~cands_to_ignore) & (~eos_mask[:, :k]))
        active_mask = eos_mask.long() * cand_size + cand_offsets[: eos_mask.size(1)]
        new_cands_to_ignore, active_hypos = torch.topk(active_mask, k=k, dim=1, largest=False)
        cands_to_ignore = new_cands_to_ignore.ge(cand_size)[:, :k]
        active_bbsz_idx = torch.gather(cand_bbsz_idx, dim=1, index=active_hypos).view(-1)
        cache_rows = torch.gather(old_cand_bbsz_idx, dim=1, index=active_hypos).view(-1)

        # each row's tokens so far (its parent's; columns past a row's own are never read), then the new one
        prefix = max(steps)
        tokens[: bsz * k, :prefix] = torch.index_select(tokens[:, :prefix], dim=0, index=cache_rows)
        tokens = tokens[: bsz * k]
        tokens[torch.arange(bsz * k, device=device), step_t.repeat_interleave(k)] = torch.gather(
            cand_indices, dim=1, index=active_hypos).view(-1)
        cum = torch.gather(cand_scores, dim=1, index=active_hypos).view(-1)
        cache.reorder(cache_rows, prefix, take_cross=bool(newly))


def _finalize(steps: list[int], bbsz_idx: torch.Tensor, eos_scores: torch.Tensor, tokens: torch.Tensor, k: int,
              lenpen: float, eos: int, finalized: list[list], max_len: list[int]) -> list[int]:
    """fairseq's finalize_hypos: store eos-ending hypotheses (each sentence at its own step); return
    batch positions now finished."""
    unfin = torch.div(bbsz_idx, k, rounding_mode="trunc").tolist()
    longest = max(steps[b] for b in unfin)
    rows = tokens.index_select(0, bbsz_idx)[:, 1: longest + 1].tolist()  # skip the decoder start token
    # the normalized score, divided by (step + 1) ** lenpen as fairseq divides (by a Python float)
    own = torch.tensor([steps[b] for b in unfin], device=eos_scores.device)
    normalized = torch.empty_like(eos_scores)
    for step in set(steps[b] for b in unfin):
        at = own == step
        normalized[at] = eos_scores[at] / (step + 1) ** lenpen
    score_list = normalized.tolist()
    for i, b in enumerate(unfin):
        slot = finalized[b]
        if len(slot) < k:
            slot.append((rows[i][: steps[b]] + [eos], score_list[i]))
    newly = []
    for b in sorted(set(unfin)):
        if len(finalized[b]) == k or steps[b] == max_len[b]:
            newly.append(b)
    return newly


def _best(req: Request, hyps: list[tuple[list[int], float]], tokens: torch.Tensor, cum: torch.Tensor,
          b: int, k: int, step: int, eos: int, pad: int, calls: int, ms: float, lenpen: float,
          nbest: int) -> BeamHypothesis:
    stats = RowStats(iterations=calls, accepted_per_iter=[0] * calls, decode_ms=ms)
    if not hyps:  # unreachable with fairseq's rules; fall back to the best live beam
        row = b * k + int(cum[b * k: (b + 1) * k].argmax())
        ranked = [(tokens[row, 1: step + 2].tolist(), float(cum[row]) / (step + 1) ** lenpen)]
    else:
        dtype = torch.float64 if cum.dtype == torch.float64 else torch.float32
        order = torch.sort(torch.tensor([s for _, s in hyps], dtype=dtype), descending=True).indices
        ranked = [hyps[i] for i in order[:nbest].tolist()]
    # fairseq strips eos (and pad) from the output string; an eos can sit inside an "ignored" beam.
    best = [([t for t in seq if t != eos and t != pad], score) for seq, score in ranked]
    return BeamHypothesis(index=req.index, tokens=best[0][0], stats=stats, score=best[0][1], nbest=best)
