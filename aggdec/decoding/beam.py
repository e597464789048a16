"""Batched beam search that reproduces fairseq 0.12's `SequenceGenerator` + `search.BeamSearch` (the
rules: docs/design.md, "Beam search"), but each sentence has its own max_len (fairseq's comes from the
batch's padded source width: the same at batch size 1) and sources are right-padded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from aggdec.decoding.candidates import chunk_for, top_candidates
from aggdec.decoding.metadata import BeamHypothesis, Request, RowStats
from aggdec.decoding.scheduler import ahead_count, pad_batch
from aggdec.model.transformer import Transformer
from aggdec.threads import THREADS


@torch.inference_mode()
def beam_search(model: Transformer, requests: list[Request], *, beam: int = 5, lenpen: float = 1.0,
                max_batch_size: int = 16, min_len: int = 1, nbest: int = 1,
                prompt: tuple[int, ...] | None = None) -> list[BeamHypothesis]:
    """Beam-search `requests` in static batches of at most `max_batch_size` sentences; results in input
    order, each with its best `nbest` (1 <= nbest <= beam) hypotheses and their scores. prompt: (decoder
    start token, forced first tokens...) as in SlotLoop; a forced token scores log-prob 0 (Hugging Face's
    convention)."""
    check_search(requests, beam, nbest, max_batch_size, min_len)
    start = prompt or (model.cfg.eos,)
    return in_batches(model, requests, max_batch_size, lambda batch, memory, src_pad: _search(
        model, batch, memory, src_pad, beam, lenpen, min_len, nbest, start))


def check_search(requests: list[Request], beam: int, nbest: int, max_batch_size: int, min_len: int) -> None:
    """Raise ValueError for a beam size, nbest, batch size or request that a beam search cannot take."""
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


def in_batches(model: Transformer, requests: list[Request], max_batch_size: int,
               search: Callable[[list[Request], torch.Tensor, torch.Tensor], Iterator[tuple[int, Any]]]) -> list:
    """`search(batch, memory, src_pad)`, yielding (position in batch, result), over static batches of
    `max_batch_size` requests, longest sources first, encoded as many batches at once as `ahead_count`
    allows and trimmed to each batch's longest source; -> the results in input order."""
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].src), reverse=True)
    device = next(model.parameters()).device
    results: dict[int, Any] = {}
    at = 0
    while at < len(order):
        count = max(1, ahead_count(len(requests[order[at]].src)) // max_batch_size) * max_batch_size
        group = [requests[i] for i in order[at: at + count]]
        memory, src_pad = model.encode(pad_batch([r.src for r in group], model.cfg.pad, device))
        for off in range(0, len(group), max_batch_size):
            batch = group[off: off + max_batch_size]
            rows, width = slice(off, off + len(batch)), max(len(r.src) for r in batch)
            for pos, result in search(batch, memory[rows, :width], src_pad[rows, :width]):
                results[order[at + off + pos]] = result
        at += len(group)
    return [results[i] for i in range(len(requests))]


def _search(model: Transformer, reqs: list[Request], memory: torch.Tensor, src_pad: torch.Tensor, beam: int,
            lenpen: float, min_len: int, nbest: int, prompt: tuple[int, ...]):
    """Yield (position in reqs, BeamHypothesis) for one static batch, given its encoder output;
    mirrors SequenceGenerator._generate."""
    pad, eos, vocab = model.cfg.pad, model.cfg.eos, model.cfg.tgt_vocab
    k = min(beam, vocab - 1)  # fairseq: the max beam size is the dictionary size - 1 (pad is never chosen)
    device = next(model.parameters()).device
    bsz = len(reqs)
    sent_max = torch.tensor([r.max_len for r in reqs], dtype=torch.long, device=device)  # (bsz,)
    max_host = [r.max_len for r in reqs]  # sent_max on the host: the step rules below read no tensor
    longest, shortest = max(max_host), min(max_host)

    # k beams per sentence, one cross K/V
    cache = model.start_from(memory, src_pad, capacity=min(longest + 1, 64), group=k, indirect=True)

    sent_ids = list(range(bsz))  # current batch position -> position in reqs
    lp_dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    scores = torch.zeros(bsz * k, longest + 1, dtype=lp_dtype, device=device)  # cumulative scores
    tokens = torch.full((bsz * k, longest + 2), pad, dtype=torch.long, device=device)
    tokens[:, 0] = prompt[0]
    forced = prompt[1:]
    cands_to_ignore = torch.zeros(bsz, k, dtype=torch.bool, device=device)
    finalized: list[list[tuple[torch.Tensor, float]]] = [[] for _ in range(bsz)]
    calls, ms = [0] * bsz, [0.0] * bsz
    cand_size = 2 * k
    cand_offsets = torch.arange(cand_size, device=device)
    chunk = chunk_for(vocab)
    neg = -math.inf

    step = 0
    THREADS.start()
    while True:
        THREADS.tick()
        t0 = time.perf_counter()
        logits = model.decode(tokens[:, step: step + 1], cache)[:, 0]  # (bsz * k, V)
        cache.commit(1)
        lprobs = torch.log_softmax(logits.to(lp_dtype), dim=-1)

        lprobs.nan_to_num_(nan=neg, posinf=math.inf, neginf=neg)  # NaN -> -inf in one pass
        lprobs[:, pad] = neg
        if step >= shortest:  # some sentence at its max_len: eos only
            force = (step >= sent_max).repeat_interleave(k)  # (bsz * k,)
            lprobs[force, :eos] = neg
            lprobs[force, eos + 1:] = neg
        if step < min_len:
            lprobs[:, eos] = neg
        if step < len(forced):
            lprobs[:] = neg
            lprobs[:, forced[step]] = 0.0

        # search.BeamSearch.step
        lp = lprobs.view(bsz, k, vocab)
        if step == 0:
            lp = lp[:, ::k, :].contiguous()
        else:
            lp = lp.add_(scores.view(bsz, k, -1)[:, :, step - 1].unsqueeze(-1))  # lprobs is not read again
        flat = lp.view(bsz, -1)
        cand_scores, cand_flat = top_candidates(flat, min(cand_size, flat.size(1) - 1), chunk)
        cand_beams = torch.div(cand_flat, vocab, rounding_mode="trunc")
        cand_indices = cand_flat.fmod(vocab)
        cand_bbsz_idx = cand_beams + (torch.arange(bsz, device=device) * k).unsqueeze(1)

        eos_mask = cand_indices.eq(eos) & cand_scores.ne(neg)
        # fairseq's quirk: a beam-indexed mask on candidate positions
        eos_mask[:, :k].masked_fill_(cands_to_ignore, False)
        eos_bbsz_idx = torch.masked_select(cand_bbsz_idx[:, :k], mask=eos_mask[:, :k])

        newly: list[int] = []
        if eos_bbsz_idx.numel() > 0:
            eos_scores = torch.masked_select(cand_scores[:, :k], mask=eos_mask[:, :k])
            newly = _finalize(step, eos_bbsz_idx, eos_scores, tokens, k, lenpen, eos, sent_ids, finalized, max_host)
        # A sentence at its max_len always gets an eos finalized above; this guards the impossible.
        if step >= shortest:
            newly += [b for b in (step >= sent_max).nonzero().flatten().tolist() if b not in newly]

        elapsed = 1000.0 * (time.perf_counter() - t0) / bsz
        for b in range(bsz):
            calls[sent_ids[b]] += 1
            ms[sent_ids[b]] += elapsed
        for b in sorted(newly):
            pos = sent_ids[b]
            yield pos, _best(reqs[pos], finalized[pos], tokens, scores, b, k, step, eos, pad, calls[pos], ms[pos],
                             lenpen, nbest)
        if len(newly) == bsz:
            return

        old_cand_bbsz_idx = cand_bbsz_idx  # rows of the cache before sentences leave
        if newly:
            keep = [b for b in range(bsz) if b not in newly]
            batch_idxs, new_bsz = torch.tensor(keep, dtype=torch.long, device=device), len(keep)
            eos_mask, cand_beams, old_cand_bbsz_idx, cand_scores, cand_indices, cands_to_ignore, sent_max = (
                t[batch_idxs] for t in (eos_mask, cand_beams, cand_bbsz_idx, cand_scores, cand_indices,
                                        cands_to_ignore, sent_max))
            cand_bbsz_idx = cand_beams + (torch.arange(new_bsz, device=device) * k).unsqueeze(1)
            scores = scores.view(bsz, -1)[batch_idxs].view(new_bsz * k, -1)
            tokens = tokens.view(bsz, -1)[batch_idxs].view(new_bsz * k, -1)
            max_host, sent_ids = [max_host[i] for i in keep], [sent_ids[i] for i in keep]
            shortest = min(max_host)
            bsz = new_bsz

        # Active hypotheses: the first k candidates that are not (unignored) eos.
        eos_mask[:, :k] = ~((~cands_to_ignore) & (~eos_mask[:, :k]))
        active_mask = eos_mask.long() * cand_size + cand_offsets[: eos_mask.size(1)]
        new_cands_to_ignore, active_hypos = torch.topk(active_mask, k=k, dim=1, largest=False)
        cands_to_ignore = new_cands_to_ignore.ge(cand_size)[:, :k]
        active_bbsz_idx = torch.gather(cand_bbsz_idx, dim=1, index=active_hypos).view(-1)
        cache_rows = torch.gather(old_cand_bbsz_idx, dim=1, index=active_hypos).view(-1)

        tokens[:, : step + 1] = torch.index_select(tokens[:, : step + 1], dim=0, index=active_bbsz_idx)
        tokens.view(bsz, k, -1)[:, :, step + 1] = torch.gather(cand_indices, dim=1, index=active_hypos)
        if step > 0:
            scores[:, :step] = torch.index_select(scores[:, :step], dim=0, index=active_bbsz_idx)
        scores.view(bsz, k, -1)[:, :, step] = torch.gather(cand_scores, dim=1, index=active_hypos)
        cache.reorder(cache_rows, step + 1, take_cross=bool(newly))
        step += 1


def _finalize(step: int, bbsz_idx: torch.Tensor, eos_scores: torch.Tensor, tokens: torch.Tensor, k: int,
              lenpen: float, eos: int, sent_ids: list[int], finalized: list[list], max_len: list[int]) -> list[int]:
    """fairseq's finalize_hypos: store eos-ending hypotheses; return batch positions now finished."""
    toks = tokens.index_select(0, bbsz_idx)[:, 1: step + 2]  # skip the decoder start token
    toks[:, step] = eos
    score_list = (eos_scores / (step + 1) ** lenpen).tolist()
    unfin = torch.div(bbsz_idx, k, rounding_mode="trunc").tolist()
    for i, b in enumerate(unfin):
        slot = finalized[sent_ids[b]]
        if len(slot) < k:
            slot.append((toks[i], score_list[i]))
    return [b for b in sorted(set(unfin)) if len(finalized[sent_ids[b]]) == k or step == max_len[b]]


def _best(req: Request, hyps: list[tuple[torch.Tensor, float]], tokens: torch.Tensor, scores: torch.Tensor,
          b: int, k: int, step: int, eos: int, pad: int, calls: int, ms: float, lenpen: float,
          nbest: int) -> BeamHypothesis:
    stats = RowStats(iterations=calls, accepted_per_iter=[0] * calls, decode_ms=ms)
    if not hyps:  # unreachable with fairseq's rules; fall back to the best live beam
        row = b * k + int(scores.view(-1, k, scores.size(1))[b, :, step].argmax())
        ranked = [(tokens[row, 1: step + 2].tolist(), float(scores[row, step]) / (step + 1) ** lenpen)]
    else:
        dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
        order = torch.sort(torch.tensor([s for _, s in hyps], dtype=dtype), descending=True).indices
        ranked = [(hyps[i][0].tolist(), hyps[i][1]) for i in order[:nbest].tolist()]
    # fairseq strips eos (and pad) from the output string; an eos can sit inside an "ignored" beam.
    best = [([t for t in seq if t != eos and t != pad], score) for seq, score in ranked]
    return BeamHypothesis(index=req.index, tokens=best[0][0], stats=stats, score=best[0][1], nbest=best)
