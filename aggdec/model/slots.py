"""Fixed-shape decoder state: a set of batch slots whose buffers never change shape during a run
(docs/design.md, "The slot loop"). A decoder call writes its block at each row's own positions, reads
a prefix of `span` key positions and `width` source positions, and masks the rest per row by its own
counts: one fixed-shape program for a given (slots, block width, span, width), with no host reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aggdec.model.cache import CrossKV


@dataclass
class Tokens:
    """A decoder call's tokens as one flat batch (vLLM's layout): token i is `ids[i]`, of slot `rows[i]`, at
    offset `offs[i]` of that slot's block and decoder position `pos[i]` (N,) each, in row-major order;
    `shape` (B, T): the slots and block width they were taken from (an eager step takes its live rows'
    real positions, a fixed-shape one every position of every slot)."""

    ids: torch.Tensor
    rows: torch.Tensor
    offs: torch.Tensor
    pos: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def of(cls, block: torch.Tensor, start: torch.Tensor, keep: torch.Tensor | None = None) -> Tokens:
        """The tokens of `block` (B, T) written from each slot's `start` (B,): where `keep` (B, T) bool
        holds (a host read), else all of them."""
        b, t = block.shape
        if keep is not None:
            rows, offs = keep.nonzero(as_tuple=True)
            return cls(block[rows, offs], rows, offs, start[rows] + offs, (b, t))
        offs = torch.arange(t, device=block.device)
        pos = start[:, None] + offs
        return cls(block.reshape(-1), torch.arange(b, device=block.device).repeat_interleave(t), offs.repeat(b),
                   pos.reshape(-1), (b, t))

    @property
    def full(self) -> bool:
        """Every position of every slot (the grid is the flat batch, reshaped)."""
        return self.ids.shape[0] == self.shape[0] * self.shape[1]

    def grid(self, values: torch.Tensor, fill) -> torch.Tensor:
        """Per-token values (N, ...) on the slot grid (B, T, ...), `fill` at positions not taken."""
        b, t = self.shape
        if self.full:
            return values.reshape(b, t, *values.shape[1:])
        out = values.new_full((b, t, *values.shape[1:]), fill)
        return out.index_put_((self.rows, self.offs), values)

    def at(self, grid: torch.Tensor) -> torch.Tensor:
        """Values on the slot grid (B, T, ...) at the tokens (N, ...)."""
        return grid.reshape(-1, *grid.shape[2:]) if self.full else grid[self.rows, self.offs]


def leading(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` rows of contiguous `t`, sharing its storage; `t` itself for all of them. Not a view
    in autograd's sense: TorchDynamo guards a view's size against its base's, so a compiled step would
    compile again for every narrowing."""
    if n == t.shape[0]:
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), (n, *t.shape[1:]), t.stride())


def capacity(need: int, floor: int) -> int:
    """Positions a buffer is allocated with to hold `need`: the power of two at or above it, at least
    `floor` (a power of two), so that a loop grows it at most log2(largest / floor) times."""
    return max(floor, 1 << (max(need, 1) - 1).bit_length())


def exact_span(n: int, limit: int) -> int:
    """The positions an eager or compiled step reads to cover `n`: n itself, at least 2 (a compiled
    program specializes sizes 0 and 1), at most `limit`: no padding past the longest row is read."""
    return min(max(n, 2), limit)


class SlotCache:
    """Self- and cross-attention buffers of `slots` rows: k, v per decoder layer (slots, length, D);
    cross_k, cross_v per layer (slots, src_width, D); src_keep (slots, src_width) bool, True at a row's
    real source positions (a prefix); src_count (slots,) int64, that prefix's length. A slot that holds
    no sentence keeps its last sentence's (or a dummy) cross K/V, so its garbage rows stay finite."""

    def __init__(self, n_layers: int, d_model: int, slots: int, length: int, src_width: int,
                 dtype: torch.dtype, device: torch.device):
        def zeros(w: int) -> list[torch.Tensor]:
            return [torch.zeros(slots, w, d_model, dtype=dtype, device=device) for _ in range(n_layers)]

        self.k, self.v = zeros(length), zeros(length)
        self.cross_k, self.cross_v = zeros(src_width), zeros(src_width)
        self.src_keep = torch.zeros(slots, src_width, dtype=torch.bool, device=device)
        self.src_keep[:, 0] = True  # empty slots attend to one zero key: finite garbage
        self.src_count = torch.ones(slots, dtype=torch.long, device=device)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer; dimension 0 is the slot."""
        return [*self.k, *self.v, *self.cross_k, *self.cross_v, self.src_keep, self.src_count]

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> SlotCache:
        """The cache whose `tensors()` are `tensors`."""
        cache, layers = object.__new__(cls), (len(tensors) - 2) // 4
        cache.k, cache.v, cache.cross_k, cache.cross_v = (tensors[i * layers: (i + 1) * layers] for i in range(4))
        cache.src_keep, cache.src_count = tensors[-2:]
        return cache

    def narrow(self, n: int) -> SlotCache:
        """The first `n` slots as a cache of their own, sharing this one's storage."""
        view = object.__new__(SlotCache)
        view.k, view.v = [leading(t, n) for t in self.k], [leading(t, n) for t in self.v]
        view.cross_k, view.cross_v = [leading(t, n) for t in self.cross_k], [leading(t, n) for t in self.cross_v]
        view.src_keep, view.src_count = leading(self.src_keep, n), leading(self.src_count, n)
        return view

    @property
    def length(self) -> int:
        return self.k[0].shape[1]

    @property
    def src_width(self) -> int:
        return self.src_keep.shape[1]

    def layer_keys(self, layer: int, lengths: torch.Tensor, span: int, src_width: int) -> tuple[torch.Tensor, ...]:
        """`layer`'s keys as a drafter reads them (`aggdec.decoding.drafters.Verified.keys`), for a
        step that read `span` key positions and `src_width` source positions; `lengths` (slots,)."""
        return (self.k[layer][:, :span], self.v[layer][:, :span], lengths, self.cross_k[layer][:, :src_width],
                self.cross_v[layer][:, :src_width], ~self.src_keep[:, :src_width])

    def place(self, slots: torch.Tensor, cross: CrossKV) -> None:
        """Put the cross K/V of new sentences (len(slots) rows, width <= src_width) into `slots`."""
        w = cross.src_pad.shape[1]
        for dst, src in zip(self.cross_k + self.cross_v, cross.k + cross.v):
            dst[slots, :w] = src.to(dst.dtype)
        keep = torch.zeros(slots.numel(), self.src_width, dtype=torch.bool, device=self.src_keep.device)
        keep[:, :w] = ~cross.src_pad
        self.src_keep[slots] = keep
        self.src_count[slots] = keep.sum(dim=1)
