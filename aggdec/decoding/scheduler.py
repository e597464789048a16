"""Admission to the decode loop (aggdec.decoding.slot_loop): how many pending requests a refill takes,
their sources padded, and their encoder passes, run ahead of admission a batch at a time (docs/design.md,
"Encode-ahead refills"); and the counters of a loop's work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aggdec.decoding.metadata import Request
from aggdec.model.cache import CrossKV
from aggdec.model.transformer import Transformer
from aggdec.thresholds import ENCODE_AHEAD, ENCODE_AHEAD_TOKENS


def pad_batch(seqs: list[list[int]], pad: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Right-pad int sequences into a (B, max_len) int64 tensor (width at least 1)."""
    width = max(1, max((len(s) for s in seqs), default=1))
    rows = [list(s) + [pad] * (width - len(s)) for s in seqs]  # one tensor call, not one a row
    out = torch.tensor(rows, dtype=torch.long) if rows else torch.full((0, width), pad, dtype=torch.long)
    return out.to(device)


def take(queue: list[Request], free_slots: int, used_tokens: int, max_tokens: int | None) -> list[Request]:
    """Pop up to `free_slots` requests off the end of `queue` (the longest, as queues are sorted by
    source length) while the active source tokens stay within `max_tokens`; an empty batch always
    takes one."""
    taken = []
    while queue and len(taken) < free_slots:
        n = len(queue[-1].src)
        if max_tokens is not None and used_tokens + n > max_tokens and (used_tokens or taken):
            break
        taken.append(queue.pop())
        used_tokens += n
    return taken


def ahead_count(longest: int) -> int:
    """Sentences encoded together by default where the longest has `longest` tokens: ENCODE_AHEAD,
    fewer where their padded tokens would pass ENCODE_AHEAD_TOKENS, at least 1."""
    return max(1, min(ENCODE_AHEAD, ENCODE_AHEAD_TOKENS // longest))


class EncodeAhead:
    """Cross K/V for refilled slots, encoded `batch` at a time ahead of admission (docs/design.md,
    "Encode-ahead refills"): a refill that was encoded ahead takes its rows; the others are encoded
    now together with the next pending requests of the queue, which then wait as cross K/V.
    `batch=None`: the loop's default, max_batch_size or `ahead_count`, whichever is more."""

    def __init__(self, model: Transformer, batch: int | None, counters: LoopCounters, max_batch_size: int):
        self.model, self.counters = model, counters
        self.batch, self.default = (max_batch_size, True) if batch is None else (batch, False)
        self.reset()

    def reset(self) -> None:
        self.cross: CrossKV | None = None  # cross K/V of pending requests encoded ahead of admission
        self.rows: dict[int, int] = {}  # id(request) -> its row in cross

    def take(self, reqs: list[Request]) -> tuple[list[Request], list[int], CrossKV | None]:
        """(reqs with those encoded ahead first, in their order; those's rows in the cross K/V encoded
        ahead, which they leave; that cross K/V). Host work only."""
        hit = [r for r in reqs if id(r) in self.rows]
        ordered = hit + [r for r in reqs if id(r) not in self.rows]
        return ordered, [self.rows.pop(id(r)) for r in hit], self.cross

    def encode(self, reqs: list[Request], queue: list[Request]) -> CrossKV | None:
        """The cross K/V of `reqs` (none encoded ahead; rows in their order, as wide as the widest), encoded
        now together with the next requests of `queue` (pop order), which then wait as cross K/V; None
        for no request."""
        if not reqs:
            return None
        device = next(self.model.parameters()).device
        longest = max(len(r.src) for r in reqs)  # the queue's are no longer
        count = max(self.batch, ahead_count(longest)) if self.default else self.batch
        ahead = queue[-1: -1 - max(0, count - len(reqs)): -1]  # admitted next (pop order)
        batch = reqs + ahead
        memory, src_pad = self.model.encode(pad_batch([r.src for r in batch], self.model.cfg.pad, device))
        self.counters.encoded_rows += len(batch)
        cross = self.model.cross_kv(memory, src_pad)
        self.cross, self.rows = cross, {id(r): len(reqs) + j for j, r in enumerate(ahead)}
        return CrossKV(k=[t[: len(reqs), :longest] for t in cross.k], v=[t[: len(reqs), :longest] for t in cross.v],
                       src_pad=cross.src_pad[: len(reqs), :longest])


@dataclass
class LoopCounters:
    """Verifier work over a loop's runs. fed: real tokens scored (last token + draft per row); padded:
    tokens computed including padding to the longest draft (B * (K + 1) per call); captures,
    capture_failures: CUDA graphs captured, and captures that failed (those steps ran eagerly);
    allocations: the times a loop allocated its slot buffers."""

    calls: int = 0
    fed: int = 0
    padded: int = 0
    encoded_rows: int = 0
    captures: int = 0
    capture_failures: int = 0
    allocations: int = 0
