"""Beam search over token pairs for double-token models (the paper's Algorithm 1, DOUBLETOPK: the rules
in docs/design.md, "Double-token models"): one decoder call per step scores the next (left, right) pair
of every beam; a left end-of-decoding keeps only its best right token, so a beam of 1 is greedy.
"""

from __future__ import annotations

import math
import time

import torch

from aggdec.decoding.acceptance import constrain_logits
from aggdec.decoding.beam import check_search, in_batches
from aggdec.decoding.candidates import chunk_for, top_candidates
from aggdec.decoding.metadata import BeamHypothesis, Request, RowStats
from aggdec.double_token import STRIDE, unfold
from aggdec.model.transformer import Transformer
from aggdec.threads import THREADS


@torch.inference_mode()
def pair_beam_search(model: Transformer, requests: list[Request], *, beam: int = 5, lenpen: float = 1.0,
                     max_batch_size: int = 16, min_len: int = 1, nbest: int = 1,
                     prompt: tuple[int, ...] | None = None) -> list[BeamHypothesis]:
    """Beam-search `requests` with a double-token `model`, as `beam_search`; prompt: (decoder start
    token,) only (the first pair fed is (bos, start))."""
    if not model.cfg.double_token:
        raise ValueError("pair_beam_search needs a double-token model (ModelConfig.double_token)")
    if prompt is not None and len(prompt) > 1:
        raise ValueError("a double-token model takes no forced first tokens")
    check_search(requests, beam, nbest, max_batch_size, min_len)
    start = prompt[0] if prompt else model.cfg.eos
    return in_batches(model, requests, max_batch_size, lambda batch, memory, src_pad: _search(
        model, batch, memory, src_pad, beam, lenpen, min_len, nbest, start))


def _search(model: Transformer, reqs: list[Request], memory: torch.Tensor, src_pad: torch.Tensor, w: int,
            lenpen: float, min_len: int, nbest: int, start: int):
    """Yield (position in reqs, BeamHypothesis) for one static batch, given its encoder output."""
    cfg = model.cfg
    pad, eos, vocab = cfg.pad, cfg.eos, cfg.tgt_vocab
    device = next(model.parameters()).device
    bsz = len(reqs)
    ids = list(range(bsz))  # batch position -> position in reqs
    sent_max = torch.tensor([r.max_len for r in reqs], dtype=torch.long, device=device)
    cache = model.start_from(memory, src_pad, capacity=64, group=w, indirect=True)  # w beams, one cross K/V
    tokens = torch.full((bsz * w, STRIDE), pad, dtype=torch.long, device=device)
    tokens[:, 0], tokens[:, 1] = cfg.bos, start
    neg = -math.inf
    lp_dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    scores = torch.full((bsz, w), neg, dtype=lp_dtype, device=device)
    scores[:, 0] = 0.0  # all beams start equal: expand the first only
    scores = scores.view(-1)
    finalized: list[list[tuple[list[int], float]]] = [[] for _ in range(bsz)]
    calls, ms = [0] * bsz, [0.0] * bsz
    chunk = chunk_for(vocab)
    step = 0
    THREADS.start()
    while bsz:
        THREADS.tick()
        t0 = time.perf_counter()
        logits = model.decode(tokens[:, -STRIDE:], cache)  # (n, 2, V)
        cache.commit(STRIDE)
        lp = torch.log_softmax(logits.to(lp_dtype), dim=-1)
        lp[lp != lp] = neg
        index = (STRIDE * step + torch.arange(STRIDE, device=device)).expand(bsz * w, STRIDE)  # stream index
        constrain_logits(lp, index, sent_max.repeat_interleave(w)[:, None].expand_as(index), pad, eos, min_len)
        lp_l, lp_r = lp[:, 0], lp[:, 1]  # (n, V)
        # DOUBLETOPK: 2W (beam, left), then 3W (beam, left, right)
        left = (scores[:, None] + lp_l).view(bsz, w * vocab)
        s1, i1 = top_candidates(left, 2 * w, chunk)  # (bsz, 2W)
        row1 = torch.div(i1, vocab, rounding_mode="trunc") + (torch.arange(bsz, device=device) * w)[:, None]  # rows
        right = lp_r[row1]  # (bsz, 2W, V)
        stop = i1.fmod(vocab) == eos  # (bsz, 2W) a left end-of-decoding ends the sentence
        best_r = right.max(dim=-1, keepdim=True).values
        right.masked_fill_(stop[..., None] & (right < best_r), neg)
        pair = (s1[..., None] + right).view(bsz, 2 * w * vocab)
        s2, i2 = top_candidates(pair, 3 * w, chunk)  # (bsz, 3W)
        which = torch.div(i2, vocab, rounding_mode="trunc")  # index into the 2W
        cand_row = row1.gather(1, which)
        cand_l = i1.gather(1, which).fmod(vocab)
        cand_r = i2.fmod(vocab)
        ended = ((cand_l == eos) | (cand_r == eos)) & (s2 > neg)

        elapsed = 1000.0 * (time.perf_counter() - t0) / bsz
        done: list[int] = []
        ended_l, rows_l, score_l, limits = ended.tolist(), cand_row.tolist(), s2.tolist(), sent_max.tolist()
        cl, cr = cand_l.tolist(), cand_r.tolist()
        for b in range(bsz):
            calls[ids[b]] += 1
            ms[ids[b]] += elapsed
            slot = finalized[ids[b]]
            for c in range(w):
                if ended_l[b][c] and len(slot) < w:
                    out = unfold(tokens[rows_l[b][c], STRIDE:].tolist() + [cl[b][c], cr[b][c]], eos)
                    slot.append((out, score_l[b][c] / (len(out) + 1) ** lenpen))
            if len(slot) >= w or STRIDE * step >= limits[b]:  # full, or every candidate had to end
                done.append(b)
        for b in done:
            yield ids[b], _best(reqs[ids[b]], finalized[ids[b]], calls[ids[b]], ms[ids[b]], nbest)
        # the W best candidates that go on (ended ones sink below every open one)
        rank = torch.where(ended, torch.full_like(s2, neg), s2)
        top, pick = rank.topk(w, dim=1)  # (bsz, W)
        rows = cand_row.gather(1, pick)
        new_pair = torch.stack([cand_l.gather(1, pick), cand_r.gather(1, pick)], dim=-1)  # (bsz, W, 2)
        if done:  # finished sentences leave in the same reordering
            keep = [b for b in range(bsz) if b not in done]
            if not keep:
                return
            at = torch.tensor(keep, dtype=torch.long, device=device)
            rows, new_pair, top, sent_max = rows[at], new_pair[at], top[at], sent_max[at]
            ids, bsz = [ids[b] for b in keep], len(keep)
        rows = rows.reshape(-1)
        tokens = torch.cat([tokens.index_select(0, rows), new_pair.reshape(-1, STRIDE)], dim=1)
        scores = top.reshape(-1)
        cache.reorder(rows, STRIDE * (step + 1), take_cross=bool(done))
        step += 1


def _best(req: Request, hyps: list[tuple[list[int], float]], calls: int, ms: float, nbest: int) -> BeamHypothesis:
    ranked = sorted(hyps, key=lambda h: -h[1])[:nbest]  # stable: the earlier finalized wins a tie
    stats = RowStats(iterations=calls, accepted_per_iter=[0] * calls, decode_ms=ms)
    return BeamHypothesis(index=req.index, tokens=ranked[0][0], stats=stats, score=ranked[0][1], nbest=ranked)
