"""Drafters: what the verifier is asked to check at each iteration of the loop (docs/design.md,
"Options and the method registry"): the protocol, greedy's empty drafter and what drafters share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from aggdec.decoding.metadata import DraftBatch
from aggdec.decoding.state import DecodeState


class Drafter(Protocol):
    """What the loop asks of a drafter. `max_draft`: the most tokens a row drafts in a call (None: no
    cap; 0: it never drafts). `from_states`: True where it drafts from the verifier's states of the call
    that just ran (the loop then calls `observe` after its step). `rows`: its per-row tensors, moved
    with the loop's slots. `source_bound` (optional, default False): True where every draft is a copy
    of the row's source (IAD): an eager loop then verifies no more draft positions than the longest
    live source has."""

    name: str
    max_draft: int | None
    from_states: bool
    rows: RowState

    def admit(self, state: DecodeState, slots: torch.Tensor) -> None:
        """New sentences were placed in `slots` (1-D index tensor) of `state`."""

    def propose(self, state: DecodeState, width: int) -> DraftBatch:
        """Drafts for every row: tokens (B, width) and each row's draft length before the loop's cut at
        `width`, with no host read (every backend runs the same step)."""

    def observe(self, state: DecodeState, draft: DraftBatch | None, accepted: torch.Tensor,
                verified: Verified | None) -> None:
        """After the call's commit: `draft` as verified (lengths cut by the loop; None for `from_states`
        drafters), `accepted` (B,) the draft tokens kept, `verified` the verifier's side of the call
        (`from_states` drafters only). Row tensors are updated in place."""


@dataclass
class Verified:
    """The verifier's side of a call, for drafters that draft from it (`StateDrafter`). hidden (B, D):
    each row's final decoder state behind its bonus token. keys(layer) -> (k, v, lengths, cross_k,
    cross_v, src_pad): that layer's self-attention keys and values (B, L, E), each row's first
    `lengths` (B,) its prefix, and cross-attention keys and values (B, S, E) with their source padding
    (B, S) bool. next_length: the most draft tokens the next call verifies."""

    hidden: torch.Tensor
    keys: Callable[[int], tuple[torch.Tensor, ...]]
    next_length: int


class RowState:
    """Named per-row tensors of a drafter, kept aligned with the loop's slots; attributes (`rows.cap`,
    `rows.cap = ...`). `admit(state, slots, name=fill, ...)` starts fresh tensors for a new batch (the
    batch size changed, or every slot was admitted and the tensors are not exactly the fills), else
    sets the refilled slots to their fill in place (no host copy). A fill is a Python scalar (a (B,)
    tensor of its type) or (scalar, width) (a (B, width) tensor)."""

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
            value, shape = (fill[0], (fill[1],)) if isinstance(fill, tuple) else (fill, ())
            if fresh:
                dtype = torch.as_tensor(value).dtype
                self._tensors[name] = torch.full((b, *shape), value, dtype=dtype, device=state.out.device)
            else:
                self._tensors[name].index_fill_(0, slots, value)
        return fresh

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by name (a new dict; set one with `rows.name = ...`)."""
        return dict(self._tensors)


class StateDrafter:
    """Base of the drafters that draft the next call's tokens from the verifier's states of the call
    that just ran: `max_draft` tokens a row, pending in `rows.pending` (B, max_draft) behind
    `rows.ready` (B,); a row's first call drafts nothing. Subclasses give `_draft(state, verified, k)`:
    each row's proposals (B, k)."""

    from_states = True

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self.rows = RowState()

    def admit(self, state: DecodeState, slots: torch.Tensor) -> None:
        self.rows.admit(state, slots, ready=False, pending=(state.pad, self.max_draft))

    def propose(self, state: DecodeState, width: int) -> DraftBatch:
        """The first `width` pending drafts of the ready rows (offered: all `max_draft`)."""
        return DraftBatch(tokens=self.rows.pending[:, :width], num_draft=torch.where(self.rows.ready, self.max_draft, 0))

    def observe(self, state: DecodeState, draft: DraftBatch | None, accepted: torch.Tensor,
                verified: Verified | None) -> None:
        """Draft the next call's tokens in place, as many as it verifies (where the next call drafts)."""
        k = min(self.max_draft, verified.next_length)
        self.rows.pending[:, :k] = self._draft(state, verified, k)
        self.rows.ready.fill_(True)


def adapt_length(length: torch.Tensor, drafted: torch.Tensor, accepted: torch.Tensor, low: int,
                 high: int) -> torch.Tensor:
    """The adaptive per-row draft length (option `adaptive_draft`), (B,) int64: doubled after a call
    whose draft (`drafted` tokens) was fully `accepted`, halved after one rejected in its first half,
    kept within [low, high]."""
    full = (accepted == drafted) & (drafted > 0)
    early = accepted < drafted // 2
    length = torch.where(full, length * 2, torch.where(early, length // 2, length))
    return length.clamp(low, high)


class NoDraft:
    """Greedy decoding: every row drafts nothing, so each call adds the verifier's token."""

    name = "greedy"
    max_draft = 0
    from_states = False

    def __init__(self) -> None:
        self.rows = RowState()

    def admit(self, state, slots):
        pass

    def propose(self, state, width):
        return DraftBatch(state.out.new_zeros(state.batch_size, 0), state.out.new_zeros(state.batch_size))

    def observe(self, state, draft, accepted, verified):
        pass
