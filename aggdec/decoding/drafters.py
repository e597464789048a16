"""Drafters: what the verifier is asked to check at each iteration of the loop.

A drafter is the batched counterpart of HF's CandidateGenerator: `propose` returns the rows' drafts
as (tokens, lengths) tensors, `observe` sees how many tokens each row accepted and, for drafters
that draft from them, the verifier's states (`Verified`). The loop tells a drafter when rows enter
(`admit`, continuous batching) and when the batch is compacted (`select`), so drafters may keep
per-row state aligned with the loop's rows (`RowState`).

Each drafter lives in its own module with its options class (iad.py, gad_head.py, blockwise.py) and is
registered in aggdec.decoding.methods. This module holds the protocol, greedy's empty drafter and
what drafters share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from aggdec.decoding.metadata import DraftBatch
from aggdec.decoding.state import DecodeState


class Drafter(Protocol):
    """What every loop asks of a drafter (one protocol for all of them).

    `max_draft`: the most tokens a row drafts in a call (None: no cap; 0: it never drafts).
    `from_states`: True where it drafts from the verifier's states of the call that just ran (the
    draft head, proposal heads): a loop that runs its step as one program then observes after it.
    """

    name: str
    max_draft: int | None
    from_states: bool

    def admit(self, state: DecodeState, slots: torch.Tensor) -> None:
        """New sentences were placed in `slots` (1-D index tensor) of `state`."""

    def select(self, rows: torch.Tensor) -> None:
        """The loop kept only `rows`, in that order."""

    def propose(self, state: DecodeState, width: int | None = None) -> DraftBatch:
        """Drafts for every row. With a `width`: a fixed-shape program (no host reads), tokens (B, width)
        and each row's draft length before the cut at `width` (the loop cuts); without: tokens (B, K),
        K the longest row's draft (the packed backend, which may read the host), lengths at most K."""

    def observe(self, state: DecodeState, draft: DraftBatch, accepted: torch.Tensor,
                verified: Verified | None) -> None:
        """After the call's commit: `draft` as verified (lengths cut by the loop; None after a step run as
        one program, for `from_states` drafters), `accepted` (B,) the draft tokens kept, `verified` the
        verifier's side of the call (None inside such a step). Row tensors are updated in place."""


@dataclass
class Verified:
    """The verifier's side of a call, for drafters that draft from it (`StateDrafter`).

    hidden (B, D): each row's final decoder state behind its bonus token. keys(layer) -> that layer's
    self-attention keys and values (B, L, E), of which each row's first `lengths` (B,) are its prefix,
    its cross-attention keys and values (B, S, E) and their source padding (B, S) bool:
    (k, v, lengths, cross_k, cross_v, src_pad), as the loop's cache holds them."""

    hidden: torch.Tensor
    keys: Callable[[int], tuple[torch.Tensor, ...]]


class RowState:
    """Named per-row tensors of a drafter, kept aligned with the loop's rows.

    `admit(state, slots, name=fill, ...)` starts fresh tensors when a new batch starts (the batch
    size changed, or every slot was admitted and the tensors are not exactly the fills) and otherwise
    sets the refilled slots to their fill in place (the tensors keep their storage); a fill
    is a scalar (a (B,) tensor of its type) or a tensor (rows of that shape). `select(rows)` keeps
    `rows`. The tensors are attributes: `rows.cap`, `rows.cap = ...`.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_tensors", {})

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: torch.Tensor) -> None:
        self._tensors[name] = value

    def admit(self, state: DecodeState, slots: torch.Tensor, **fills: Any) -> bool:
        """-> True when this started a new batch (all tensors fresh)."""
        b = state.batch_size
        fresh = (not self._tensors or any(t.shape[0] != b for t in self._tensors.values())
                 or (slots.numel() == b and set(self._tensors) != set(fills)))
        if fresh:
            self._tensors.clear()
        for name, fill in fills.items():
            row = torch.as_tensor(fill, device=state.out.device)
            if fresh:
                self._tensors[name] = row.expand(b, *row.shape).clone()
            else:
                self._tensors[name][slots] = row
        return fresh

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by name (a new dict; set one with `rows.name = ...`)."""
        return dict(self._tensors)

    def select(self, rows: torch.Tensor) -> None:
        for name, t in self._tensors.items():
            self._tensors[name] = t.index_select(0, rows)


class StateDrafter:
    """Base of the drafters that draft the next call's tokens from the verifier's states of the call
    that just ran (the draft head, proposal heads): up to `max_draft` tokens a row, pending in
    `rows.pending` (B, max_draft) behind `rows.ready` (B,). A row's first call drafts nothing (there is
    no verifier state yet). `observe` drafts the next call's length (`state.next_draft`), none where it
    drafts nothing. Subclasses give `_draft(state, verified, k)`: each row's proposals (B, k)."""

    from_states = True

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self.rows = RowState()
        self._k = 0  # the length of the pending drafts

    def admit(self, state: DecodeState, slots: torch.Tensor) -> None:
        self.rows.admit(state, slots, ready=False,
                        pending=torch.full((self.max_draft,), state.pad, dtype=torch.long))
        if slots.numel() == state.batch_size:  # no row is ready
            self._k = 0

    def select(self, rows: torch.Tensor) -> None:
        self.rows.select(rows)

    def propose(self, state: DecodeState, width: int | None = None) -> DraftBatch:
        """The pending drafts of the ready rows: with a `width`, its first `width` (offered: all
        `max_draft`); without, the `_k` the last `observe` drafted (none after it drafted none or
        every row was admitted since; with `_k` > 0 some row is ready: refills replace only some rows)."""
        ready = self.rows.ready
        if width is not None:
            return DraftBatch(tokens=self.rows.pending[:, :width], num_draft=torch.where(ready, self.max_draft, 0))
        if self._k == 0:
            return DraftBatch.empty(state.batch_size, state.out.device, state.pad)
        return DraftBatch(tokens=self.rows.pending[:, : self._k], num_draft=torch.where(ready, self._k, 0))

    def observe(self, state: DecodeState, draft: DraftBatch, accepted: torch.Tensor,
                verified: Verified | None) -> None:
        """Draft the next call's tokens, in place; none where the next call drafts nothing (`propose`
        then reads no row, and a call that drafts makes every row ready)."""
        self._k = state.next_draft(self.max_draft)
        if self._k == 0:
            return
        self.rows.pending[:, : self._k] = self._draft(state, verified, self._k)
        self.rows.ready.fill_(True)

    def _draft(self, state: DecodeState, verified: Verified, k: int) -> torch.Tensor:
        raise NotImplementedError


def adapt_length(length: torch.Tensor, drafted: torch.Tensor, accepted: torch.Tensor, low: int,
                 high: int) -> torch.Tensor:
    """The adaptive per-row draft length (option `adaptive_draft`): doubled after a call whose draft
    was fully accepted, halved after one rejected in its first half, kept within [low, high].

    length, drafted, accepted: (B,) int64 (drafted: tokens proposed, accepted: tokens kept)."""
    full = (accepted == drafted) & (drafted > 0)
    early = accepted < drafted // 2
    length = torch.where(full, length * 2, torch.where(early, length // 2, length))
    return length.clamp(low, high)


class NoDraft:
    """Greedy decoding: every row drafts nothing, so each call adds the verifier's token."""

    name = "greedy"
    max_draft = 0
    from_states = False

    def admit(self, state, slots):
        pass

    def select(self, rows):
        pass

    def propose(self, state, width=None):
        return DraftBatch.empty(state.batch_size, state.out.device, state.pad)

    def observe(self, state, draft, accepted, verified):
        pass
