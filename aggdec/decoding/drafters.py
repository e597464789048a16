"""Drafters: what the verifier is asked to check at each iteration of the loop.

A drafter is the batched counterpart of HF's CandidateGenerator: `propose` returns a ragged
DraftBatch for the active rows, `observe` sees how many tokens each row accepted. The loop tells a
drafter when rows enter (`admit`, continuous batching) and when the batch is compacted
(`select`), so drafters may keep per-row state aligned with the loop's rows (`RowState`).

Each drafter lives in its own module with its options class (iad.py, gad_head.py, blockwise.py) and is
registered in aggdec.decoding.methods. This module holds the protocol, greedy's empty drafter and
what drafters share.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from aggdec.decoding.metadata import DraftBatch
from aggdec.decoding.state import DecodeState


class Drafter(Protocol):
    name: str

    def admit(self, state: DecodeState, slots: torch.Tensor) -> None:
        """New sentences were placed in `slots` (1-D index tensor) of `state`."""

    def select(self, rows: torch.Tensor) -> None:
        """The loop kept only `rows`, in that order."""

    def propose(self, state: DecodeState) -> DraftBatch:
        """Drafts for every active row (possibly empty)."""

    def observe(self, state: DecodeState, draft: DraftBatch, accepted: torch.Tensor, hidden: torch.Tensor) -> None:
        """accepted (B,): draft tokens kept in the call that just ran (rows not yet removed);
        hidden (B,D): the verifier's final decoder state that produced each row's bonus token
        (blockwise heads propose from it)."""


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
    no verifier state yet).

    In the row loop, `observe` drafts the next call's length (`state.next_draft`), none where it
    drafts nothing; in the slot loop (`aggdec.decoding.slot_loop`), `draft_fixed` hands each call its
    width of the pending tokens and `draft_after` drafts all `max_draft` of them, in place (their
    storage stays put for CUDA graphs), once the loop knows the next call drafts. Subclasses give
    `_draft(state, hidden, k)` (the row loop's cache) and `_draft_slots(state, hidden, span, src_width)`
    (the slot loop's), each row's proposals (B, k) from its state `hidden` (B, D)."""

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self.rows = RowState()
        self._k = 0  # the row loop's length of the pending drafts

    def admit(self, state: DecodeState, slots: torch.Tensor) -> None:
        self.rows.admit(state, slots, ready=False,
                        pending=torch.full((self.max_draft,), state.pad, dtype=torch.long))
        if slots.numel() == state.batch_size:  # no row is ready
            self._k = 0

    def select(self, rows: torch.Tensor) -> None:
        self.rows.select(rows)

    def propose(self, state: DecodeState) -> DraftBatch:
        """The pending drafts of the ready rows; none where the last `observe` drafted none or every
        row was admitted since (with `_k` > 0 some row is ready: refills replace only some rows)."""
        if self._k == 0:
            return DraftBatch.empty(state.batch_size, state.out.device, state.pad)
        return DraftBatch(tokens=self.rows.pending[:, : self._k].clone(),
                          num_draft=torch.where(self.rows.ready, self._k, 0))

    def observe(self, state: DecodeState, draft: DraftBatch, accepted: torch.Tensor, hidden: torch.Tensor) -> None:
        """Draft the next call's tokens (the row loop runs it under inference mode); none where the next
        call drafts nothing (`propose` then reads no row, and a call that drafts makes every row ready)."""
        self._k = state.next_draft(self.max_draft)
        if self._k == 0:
            return
        drafts = self._draft(state, hidden, self._k)
        self.rows.pending = torch.nn.functional.pad(drafts, (0, self.max_draft - self._k), value=state.pad)
        self.rows.ready = torch.ones_like(self.rows.ready)

    def draft_fixed(self, state: DecodeState, width: int, depth: int) -> tuple[DraftBatch, torch.Tensor]:
        """`propose` as a fixed-shape tensor program: each ready row's first `width` pending tokens
        (B, width), and the length offered before that cut (B,). `depth` is IAD's (unused)."""
        ready = self.rows.ready
        return (DraftBatch(tokens=self.rows.pending[:, :width], num_draft=torch.where(ready, width, 0)),
                torch.where(ready, self.max_draft, 0))

    def draft_after(self, state: DecodeState, hidden: torch.Tensor, accepted: torch.Tensor, span: int,
                    src_width: int) -> None:
        """`observe` for the slot loop, after a call where the next call drafts: every slot's
        `max_draft` tokens from the call's states `hidden` (B, T, D) at its last verified position
        (`accepted`), the call's `span` and `src_width`; every slot is then ready."""
        behind = hidden.gather(1, accepted[:, None, None].expand(-1, 1, hidden.shape[-1])).squeeze(1)
        self.rows.pending.copy_(self._draft_slots(state, behind, span, src_width))
        self.rows.ready.fill_(True)

    def _draft(self, state: DecodeState, hidden: torch.Tensor, k: int) -> torch.Tensor:
        raise NotImplementedError

    def _draft_slots(self, state: DecodeState, hidden: torch.Tensor, span: int, src_width: int) -> torch.Tensor:
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

    def admit(self, state, slots):
        pass

    def select(self, rows):
        pass

    def propose(self, state):
        return DraftBatch.empty(state.batch_size, state.out.device, state.pad)

    def observe(self, state, draft, accepted, hidden):
        pass
