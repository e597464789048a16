"""Per-row decoder state: ragged self-attention KV cache with per-row rollback, and cross-attention K/V.

Layout: one row per sentence in the batch ("slot"). Self-attention keys/values live in buffers of
shape (B, L_cap, D) per layer; row b's valid prefix is `lengths[b]` positions. Writing a block of T
new tokens puts them at positions lengths[b] .. lengths[b]+T-1 for every row (padding included);
`commit(n)` then advances each row by its own accepted count n[b] <= T. Anything written past the
committed length is garbage that later writes overwrite and attention masks out, so rollback is
free: it is just not advancing the length.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from aggdec.model import decode_attention


@dataclass
class CrossKV:
    """Cross-attention keys/values computed once per sentence.

    k, v: per decoder layer, (B, S, D). src_pad: (B, S) bool, True at padding.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    src_pad: torch.Tensor

    @cached_property
    def keep(self) -> torch.Tensor:
        """(B,1,1,S) bool, True at real source positions; made on first use and kept: `src_pad` must
        not change in place afterwards (`DecoderCache.replace`, which writes rows into it, then makes
        a new CrossKV of the same tensors)."""
        return (~self.src_pad)[:, None, None, :]

    @cached_property
    def count(self) -> torch.Tensor:
        """(B,) int64: each row's real source positions; made once, as `keep`."""
        return self.keep.sum(dim=-1).view(-1)

    def take(self, rows: torch.Tensor, trim: bool = False) -> "CrossKV":
        """The given rows (1-D index tensor), in that order; `trim` also drops source positions that
        are padding in every one of them."""
        width = int((~self.src_pad[rows]).sum(dim=1).max()) if trim and rows.numel() else self.src_pad.shape[1]
        return CrossKV(k=[t[:, :width].index_select(0, rows) for t in self.k],
                       v=[t[:, :width].index_select(0, rows) for t in self.v],
                       src_pad=self.src_pad[:, :width].index_select(0, rows))


class DecoderCache:
    """Self-attention cache for `n_layers` layers plus the cross-attention K/V of each row.

    Invariants: lengths (B,) int64 on the model's device; every row's buffer holds valid K/V for
    positions < lengths[b]; `capacity >= lengths.max()`; `length`, where not None, equals every
    lengths[b] (so lengths change through `commit`, `reorder`, `select` and `replace`); an indirect
    cache's `length` is never None.
    """

    def __init__(self, cross: CrossKV, n_layers: int, d_model: int, capacity: int = 64, group: int = 1,
                 indirect: bool = False):
        """group: every row of `cross` serves `group` consecutive rows (row b -> rows b*group ..
        b*group+group-1), for beam search: each sentence's cross K/V is kept (and read) once for all
        its beams instead of once per beam. indirect: `reorder` moves no K/V but a map of where each
        row's positions are stored (`rows`), where the CPU attention kernel reads this cache
        (`decode_attention.usable`; elsewhere `reorder` copies)."""
        b = cross.src_pad.shape[0] * group
        ref = cross.k[0]
        self.cross = cross
        self.group = group  # consecutive rows that share one row of `cross` (beam search: the beams of a sentence)
        self._heads: tuple[CrossKV, list[tuple[torch.Tensor, torch.Tensor]]] | None = None  # cross_heads' memo
        self.lengths = torch.zeros(b, dtype=torch.long, device=ref.device)
        self.length: int | None = 0  # every row's length where all are equal and the host knows it (`commit`)
        self._longest: int | None = 0  # the longest row's length where the host knows it (`longest`)
        # (B0, capacity) with B0 the first batch size: position j of row b is stored in row rows[b, j] of
        # k and v (each row writes its new positions into its own buffer row); None: in row b
        indirect = indirect and decode_attention.usable(ref.device, ref.dtype)
        self.rows = self._identity(b, capacity) if indirect else None
        # the kernel reads no position past a row's length: those of an indirect cache stay unwritten
        # (masked products would multiply their garbage by 0: elsewhere they are zeros)
        self._new = torch.Tensor.new_empty if indirect else torch.Tensor.new_zeros
        self.k = [self._new(ref, (b, capacity, d_model)) for _ in range(n_layers)]
        self.v = [self._new(ref, (b, capacity, d_model)) for _ in range(n_layers)]
        # (B / group,) with `indirect`: the row of `cross` of each group of rows (taking sentences moves no
        # cross K/V); None: row b' of `cross`
        self.sources = torch.arange(cross.src_pad.shape[0], device=ref.device) if indirect else None
        # `reorder`'s buffers (k then v): the spare set, and the full tensors the live rows are a view of
        self._spare: list[torch.Tensor] = []
        self._full: list[torch.Tensor] = []

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def longest(self) -> int:
        """The longest row's length: `length` where it is known, else read from `lengths` once and kept
        on the host while commits advance every row by one count (a greedy run reads it after
        each refill or finished row, not at every call)."""
        if self.length is not None:
            return self.length
        if self._longest is None:
            self._longest = int(self.lengths.max()) if self.batch_size else 0
        return self._longest

    def layer_keys(self, layer: int) -> tuple[torch.Tensor, ...]:
        """`layer`'s keys as a drafter reads them (`aggdec.decoding.drafters.Verified.keys`)."""
        span, cross = self.longest, self.cross
        return self.k[layer][:, :span], self.v[layer][:, :span], self.lengths, cross.k[layer], cross.v[layer], cross.src_pad

    def reserve(self, extra: int) -> None:
        """Grow buffers so that every row can take `extra` more positions."""
        need = self.longest + extra
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity)
        for buf in (self.k, self.v):
            for i, t in enumerate(buf):
                grown = self._new(t, (t.shape[0], new_cap, t.shape[2]))
                grown[:, : t.shape[1]] = t
                buf[i] = grown
        self._full = []
        if self.rows is not None:
            grown = self._identity(self.rows.shape[0], new_cap)
            grown[:, : self.rows.shape[1]] = self.rows
            self.rows = grown

    def _identity(self, b: int, capacity: int) -> torch.Tensor:
        return torch.arange(b, device=self.lengths.device)[:, None].expand(b, capacity).contiguous()

    def cross_rows(self) -> torch.Tensor | None:
        """(B,): the row of `cross` each row reads; None where row b reads row b."""
        if self.group == 1 and self.sources is None:
            return None
        group = torch.arange(self.batch_size, device=self.lengths.device) // self.group
        return group if self.sources is None else self.sources[group]

    def key_rows(self, span: int) -> torch.Tensor | None:
        """(B, span): the buffer row of each row's first `span` positions (`rows`), for the attention
        kernel; None where every row's positions are in its own buffer row."""
        return None if self.rows is None else self.rows[: self.batch_size, :span]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              where: tuple[torch.Tensor, torch.Tensor] | None = None, span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a block's K/V and return the visible prefix (B, span, D) of this layer (with `rows`: the
        first `span` positions of every buffer row, which `key_rows` maps).

        k, v: (B, T, D), stored at positions lengths[b] + t; or packed (N, D) with `where` = (rows,
        positions), each (N,). `span` defaults to lengths.max() + T. The caller masks keys at or
        beyond each query's own limit.
        """
        if where is None and self.length is not None:  # every row at one length: a block of positions
            bsz, t = k.shape[:2]
            self.k[layer][:bsz, self.length: self.length + t] = k
            self.v[layer][:bsz, self.length: self.length + t] = v
            span = span or self.length + t
        else:
            if where is None:
                bsz, t = k.shape[:2]
                pos = self.lengths[:, None] + torch.arange(t, device=k.device)  # (B, T)
                rows = torch.arange(bsz, device=k.device)[:, None].expand(bsz, t)
                where = (rows, pos)
                span = span or self.longest + t
            if self.rows is not None:
                raise ValueError("an indirect cache takes blocks of positions at its rows' one length")
            self.k[layer][where] = k
            self.v[layer][where] = v
        return self.k[layer][:, :span], self.v[layer][:, :span]

    def commit(self, n: torch.Tensor | int) -> None:
        """Advance row b by n[b] positions of the block just written; the rest is rolled back. An int
        advances every row by it (and keeps `length` known where it was); an indirect cache takes
        only that (its rows write past their length into buffer rows whose earlier positions other
        rows may read, so they stay at one length)."""
        if self.rows is not None and not isinstance(n, int):
            raise ValueError("an indirect cache advances every row by one count (commit an int)")
        self.lengths = self.lengths + n
        self.length = self.length + n if isinstance(n, int) and self.length is not None else None
        self._longest = self._longest + n if isinstance(n, int) and self._longest is not None else None

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (1-D index tensor), in that order: finished rows leave, beams reorder."""
        if self.group != 1 or self.rows is not None:
            raise ValueError("select takes rows with their own cross K/V and buffer rows (beam search's: reorder)")
        self.lengths = self.lengths.index_select(0, rows)
        self._longest = None
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]
        self.cross = self.cross.take(rows)

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
        """Beam search's `select`: row i becomes row rows[i] (rows may repeat and leave), copying only
        the first `prefix` positions of the self-attention buffers (prefix >= every row's length). With
        cross K/V shared by groups of rows (`group`), rows keep their groups: the rows of a new
        group come from one old group.

        The copy goes into a second set of buffers that then swaps with the first, so no memory is
        allocated once both exist; positions at or past a row's length hold stale finite values,
        masked as ever. With `indirect` (`self.rows` set), nothing is copied but that map's first
        `prefix` positions (and `sources` for the cross K/V). take_cross: also take the cross K/V by
        `rows`; False where every new row keeps the cross K/V it has (the beams of one sentence share
        theirs, so reordering them needs none).
        """
        if take_cross:  # with shared cross K/V, each group's rows come from one sentence
            groups = rows if self.group == 1 else rows[:: self.group] // self.group
            if self.sources is None:
                self.cross = self.cross.take(groups)
            else:
                self.sources = self.sources[groups]
        self.lengths = self.lengths.index_select(0, rows)
        self._longest = None
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

    def trim_cross(self, keep: float = 0.75) -> None:
        """Drop the source positions that are padding in every row once they are more than 1 - `keep`
        of the cross K/V's width. Admission is longest first, so refilled rows are shorter than the
        batch's width and single-query cross-attention would otherwise read the first batch's
        padding to the end (masked, so nothing changes but the time)."""
        width = self.cross.src_pad.shape[1]
        if self.batch_size and int((~self.cross.src_pad).sum(dim=1).max()) < keep * width:
            self.cross = self.cross.take(torch.arange(self.batch_size, device=self.lengths.device), trim=True)

    def replace(self, slots: torch.Tensor, cross: CrossKV) -> None:
        """Put new sentences into `slots` (continuous batching): their cross K/V, length 0.

        `cross` holds len(slots) rows; its source length may differ from the batch's (padded to fit).
        Not with `rows` (a slot's buffer row may hold positions other rows read).
        """
        if self.rows is not None:
            raise ValueError("replace needs rows that own their buffer rows (a cache without `indirect`)")
        s_old, s_new = self.cross.src_pad.shape[1], cross.src_pad.shape[1]
        if s_new > s_old:
            grow = s_new - s_old
            self.cross = CrossKV(
                k=[torch.nn.functional.pad(t, (0, 0, 0, grow)) for t in self.cross.k],
                v=[torch.nn.functional.pad(t, (0, 0, 0, grow)) for t in self.cross.v],
                src_pad=torch.nn.functional.pad(self.cross.src_pad, (0, grow), value=True),
            )
            s_old = s_new
        for dst, src in zip(self.cross.k + self.cross.v, cross.k + cross.v):
            dst[slots] = torch.nn.functional.pad(src, (0, 0, 0, s_old - s_new))
        self.cross.src_pad[slots] = torch.nn.functional.pad(cross.src_pad, (0, s_old - s_new), value=True)
        self.cross = CrossKV(k=self.cross.k, v=self.cross.v, src_pad=self.cross.src_pad)  # without its masks
        self.lengths[slots] = 0
        self.length = self._longest = None
