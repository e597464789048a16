"""Decoder state of beam search and teacher-forced passes: a self-attention KV cache whose rows advance
together, and cross-attention K/V (docs/design.md, "Caches"); the slot loop's is aggdec.model.slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from aggdec.model import decode_attention


@dataclass
class CrossKV:
    """Cross-attention keys/values computed once per sentence: k, v per decoder layer, (B, S, D);
    src_pad (B, S) bool, True at padding."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    src_pad: torch.Tensor

    @cached_property
    def keep(self) -> torch.Tensor:
        """(B,1,1,S) bool, True at real source positions; made on first use and kept: `src_pad` must
        not change in place afterwards."""
        return (~self.src_pad)[:, None, None, :]

    @cached_property
    def count(self) -> torch.Tensor:
        """(B,) int64: each row's real source positions; made once, as `keep`."""
        return self.keep.sum(dim=-1).view(-1)

    def take(self, rows: torch.Tensor, width: int | None = None) -> "CrossKV":
        """The given rows (1-D index tensor), in that order, at the first `width` source positions (None: all)."""
        return CrossKV(k=[t[:, :width].index_select(0, rows) for t in self.k],
                       v=[t[:, :width].index_select(0, rows) for t in self.v],
                       src_pad=self.src_pad[:, :width].index_select(0, rows))


class DecoderCache:
    """Self-attention cache for `n_layers` layers, buffers (B, capacity, D), plus the cross-attention
    K/V. Every row is at one length, `length` (also `lengths`, (B,) int64 on the model's device); a
    block of T written tokens goes to positions length .. length+T-1, `commit(n)` keeps n. group: every
    row of `cross` serves `group` consecutive rows (a sentence's beams). indirect: `reorder` moves no
    K/V but a map of where each row's positions are stored (`rows`), where the CPU attention kernel
    reads this cache (`decode_attention.usable`)."""

    def __init__(self, cross: CrossKV, n_layers: int, d_model: int, capacity: int = 64, group: int = 1,
                 indirect: bool = False):
        b, ref = cross.src_pad.shape[0] * group, cross.k[0]
        self.cross, self.group = cross, group
        self._heads: tuple[CrossKV, list[tuple[torch.Tensor, torch.Tensor]]] | None = None  # cross_heads' memo
        self.lengths = torch.zeros(b, dtype=torch.long, device=ref.device)
        self.length = 0
        # (B0, capacity), B0 the first batch size: position j of row b is in row rows[b, j] of k, v; None: row b
        indirect = indirect and decode_attention.usable(ref.device, ref.dtype)
        self.rows = self._identity(b, capacity) if indirect else None
        # unwritten positions: never read by the kernel (indirect), zeros for masked products (0 * garbage: NaN)
        self._new = torch.Tensor.new_empty if indirect else torch.Tensor.new_zeros
        self.k = [self._new(ref, (b, capacity, d_model)) for _ in range(n_layers)]
        self.v = [self._new(ref, (b, capacity, d_model)) for _ in range(n_layers)]
        # (B / group,) with `indirect`: the row of `cross` of each group of rows; None: row b' of `cross`
        self.sources = torch.arange(cross.src_pad.shape[0], device=ref.device) if indirect else None
        # `reorder`'s buffers (k then v): the spare set, and the full tensors the live rows are a view of
        self._spare: list[torch.Tensor] = []
        self._full: list[torch.Tensor] = []

    def reserve(self, extra: int) -> None:
        """Grow buffers so that every row can take `extra` more positions."""
        need, capacity = self.length + extra, self.k[0].shape[1]
        if need <= capacity:
            return
        new_cap = max(need, 2 * capacity)
        for buf in (self.k, self.v):
            for i, t in enumerate(buf):
                buf[i] = torch.cat([t, self._new(t, (t.shape[0], new_cap - t.shape[1], t.shape[2]))], dim=1)
        self._full = []
        if self.rows is not None:
            b, have = self.rows.shape
            self.rows = torch.cat([self.rows, self._identity(b, new_cap - have)], dim=1)

    def _identity(self, b: int, capacity: int) -> torch.Tensor:
        return torch.arange(b, device=self.lengths.device)[:, None].expand(b, capacity).contiguous()

    def cross_rows(self) -> torch.Tensor | None:
        """(B,): the row of `cross` each row reads; None where row b reads row b."""
        if self.group == 1 and self.sources is None:
            return None
        group = torch.arange(self.lengths.shape[0], device=self.lengths.device) // self.group
        return group if self.sources is None else self.sources[group]

    def key_rows(self, span: int) -> torch.Tensor | None:
        """(B, span): the buffer row of each row's first `span` positions (`rows`), for the attention
        kernel; None where every row's positions are in its own buffer row."""
        return None if self.rows is None else self.rows[: self.lengths.shape[0], :span]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a block's K/V (B, T, D) at positions length .. length + T - 1 -> the first `span` positions
        (B, span, D) of this layer's buffers (with `rows`: of every buffer row, mapped by `key_rows`), unmasked."""
        bsz, t = k.shape[:2]
        self.k[layer][:bsz, self.length: self.length + t] = k
        self.v[layer][:bsz, self.length: self.length + t] = v
        return self.k[layer][:, :span], self.v[layer][:, :span]

    def commit(self, n: int) -> None:
        """Advance every row by `n` positions of the block just written; the rest is rolled back."""
        self.lengths = self.lengths + n
        self.length += n

    def cross_heads(self, layer: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s cross K/V split into `heads` heads, (B', H, S, D/H) each, contiguous: made once
        per cross K/V (shared-cross attention reads them every step)."""
        if self._heads is None or self._heads[0] is not self.cross:
            split = [t.unflatten(-1, (heads, t.shape[-1] // heads)).transpose(1, 2).contiguous()
                     for t in self.cross.k + self.cross.v]
            n = len(self.cross.k)
            self._heads = (self.cross, list(zip(split[:n], split[n:])))
        return self._heads[1][layer]

    def reorder(self, rows: torch.Tensor, prefix: int, take_cross: bool) -> None:
        """Beam search's `select`: row i becomes row rows[i] (rows may repeat and leave; with `group`, a
        new group's rows come from one old group), copying the first `prefix` positions (>= every row's
        length) into spare buffers that then swap with these, or with `indirect`, only the map `rows`.
        take_cross: also take the cross K/V by `rows` (False where every row keeps its sentence's)."""
        if take_cross:
            groups = rows if self.group == 1 else rows[:: self.group] // self.group
            if self.sources is None:
                self.cross = self.cross.take(groups)
            else:
                self.sources = self.sources[groups]
        self.lengths = self.lengths.index_select(0, rows)
        if self.rows is not None:  # positions stay where they were written: new rows read their parents'
            self.rows[: rows.numel(), :prefix] = self.rows[:, :prefix].index_select(0, rows)
            return
        n, layers = rows.numel(), len(self.k)
        live = self.k + self.v
        full = self._full or live
        if not self._spare or self._spare[0].shape[1:] != live[0].shape[1:] or self._spare[0].shape[0] < n:
            self._spare = [t.new_zeros(max(n, t.shape[0]), *t.shape[1:]) for t in live]
        for src, dst in zip(live, self._spare):
            torch.index_select(src[:, :prefix], 0, rows, out=dst[:n, :prefix])
        moved = [t[:n] for t in self._spare]
        self._full, self._spare = self._spare, full
        self.k, self.v = moved[:layers], moved[layers:]
