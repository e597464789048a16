"""Acceptance criteria: how many draft tokens the verifier keeps, and what it adds after them.

Glossary (per row, one verifier call on [last token ; d_1 .. d_n]):
- verifier prediction p_t: the verifier's choice for the token after position t (t = 0..n).
- accepted tokens: the longest prefix d_1 .. d_m of the draft that the criterion keeps.
- bonus token: the verifier's p_m, appended after the accepted tokens, even when the whole draft is
  accepted, so every call makes progress.
The row commits d_1 .. d_m, p_m: m + 1 tokens.

`ExactMatch` (top-1) keeps the output identical to greedy decoding. `TopKTolerance` is GAD++.
Criteria read the verifier through `VerifierScores` (top-1 only, or full logits computed on first use)
at the call's verified tokens (`Tokens`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from aggdec.model.projection import OutputProjection, Rules
from aggdec.model.slots import Tokens


def constrain_logits(logits: torch.Tensor, out_index: torch.Tensor, max_len: torch.Tensor, pad: int, eos: int,
                     min_len: int = 1, forced: torch.Tensor | None = None) -> torch.Tensor:
    """fairseq-generate's per-step rules (`Rules`), in place, on verifier logits (..., V), with no host
    read: out_index (...) int64 the output index each position predicts, max_len (...) its row's limit."""
    return Rules(out_index, max_len, pad, eos, min_len, forced).apply(logits)


class VerifierScores:
    """The verifier's scores at the N verified tokens of a call (`Tokens`, in their order): top1 (N,)
    int64, the exact argmax of the constrained fp32 logits (certified bf16 or fp32, as `projection`
    decides); logits (N, V) fp32 (float64 for a float64 verifier), the constrained logits. Each computed
    on first use, memoized by hand (TorchDynamo breaks at `cached_property`)."""

    def __init__(self, projection: OutputProjection | None, hidden: torch.Tensor | None, rules: Rules | None,
                 logits: torch.Tensor | None = None):
        self.projection, self.hidden, self.rules = projection, hidden, rules
        self._logits, self._top1 = logits, None

    @classmethod
    def of(cls, logits: torch.Tensor) -> "VerifierScores":
        """Scores over given constrained logits (N, V)."""
        return cls(None, None, None, logits)

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = self.rules.apply(self.projection.logits(self.hidden))
        return self._logits

    @property
    def top1(self) -> torch.Tensor:
        if self._top1 is None:  # from the logits where they were computed (GAD++): their argmax is free
            self._top1 = (self.projection.top1(self.hidden, self.rules) if self._logits is None
                          else self._logits.argmax(dim=-1))
        return self._top1


class Acceptance(Protocol):
    def describe(self) -> str:
        """The rule and its parameters, for output signatures."""

    def accept(self, draft: torch.Tensor, num_draft: torch.Tensor, scores: VerifierScores,
               tokens: Tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide per row, with no host read: draft (B,K) int64; num_draft (B,); tokens: the call's
        verified tokens on the grid (B, K+S), S the verifier's tokens per step (1; 2 for a double-token
        model, whose bonus is the pair at positions m, m + 1), at least those at offsets
        t < num_draft[b] + S of each live row; scores: the verifier at those tokens; offset t predicts
        the token after draft token t (t = 0: after the last). -> (accepted (B,) int64, bonus (B,) int64)."""


def _accepted(ok: torch.Tensor, num_draft: torch.Tensor, pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted, bonus): the leading run of True in ok (B,K) limited to num_draft, and pred (B,K+S) after it."""
    valid = torch.arange(ok.shape[1], device=ok.device)[None] < num_draft[:, None]
    m = torch.cumprod((ok & valid).long(), dim=1).sum(dim=1)
    return m, pred.gather(1, m[:, None]).squeeze(1)


class ExactMatch:
    """Accept a draft token iff it is the verifier's argmax (lossless)."""

    name = "exact"

    def describe(self) -> str:
        return self.name

    def accept(self, draft, num_draft, scores, tokens):
        pred = tokens.grid(scores.top1, -1)  # (B, K+S)
        return _accepted(pred[:, : draft.shape[1]] == draft, num_draft, pred)


class TopKTolerance:
    """GAD++: accept d_t if it is in the verifier's top-`beta` and log p(top1) - log p(d_t) <= `tau`
    (beta=1: ExactMatch). The bonus token is the verifier's top-1. A call in which no row drafted
    reads the top-1 alone, as ExactMatch does."""

    name = "topk"

    def __init__(self, beta: int, tau: float):
        if beta < 1:
            raise ValueError(f"top-beta must be >= 1, got {beta}")
        if tau < 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        self.beta, self.tau = beta, tau

    def describe(self) -> str:
        return f"top{self.beta}-tau{self.tau}"

    def accept(self, draft, num_draft, scores, tokens):
        if draft.shape[1] == 0:  # nothing to check (a plain greedy step): top-1 without full logits
            return ExactMatch().accept(draft, num_draft, scores, tokens)
        logp = torch.log_softmax(scores.logits.float(), dim=-1)  # (N, V)
        top = logp.topk(self.beta, dim=-1)
        # the token each position is checked against: the next draft token (or none)
        nxt = tokens.at(torch.nn.functional.pad(draft, (0, tokens.shape[1] - draft.shape[1]), value=-1))
        in_top = (top.indices == nxt[:, None]).any(-1)
        gap = top.values[:, 0] - logp.gather(-1, nxt.clamp(min=0)[:, None])[:, 0]
        ok = tokens.grid(in_top & (gap <= self.tau) & gap.isfinite(), False)[:, : draft.shape[1]]  # never a -inf
        return _accepted(ok, num_draft, tokens.grid(top.indices[:, 0], -1))


class MinBlock:
    """Stern et al.'s minimum block size (approximate): keep the first `min_block` draft tokens (as far
    as drafted), `inner` deciding the rest of the prefix."""

    name = "minblock"

    def __init__(self, inner: Acceptance, min_block: int):
        if min_block < 1:
            raise ValueError(f"min_block must be >= 1, got {min_block}")
        self.inner, self.min_block = inner, min_block

    @classmethod
    def around(cls, inner: Acceptance, min_block: int) -> Acceptance:
        """`inner` with a minimum block of `min_block` tokens (0: `inner` itself)."""
        return cls(inner, min_block) if min_block else inner

    def describe(self) -> str:
        return f"minblock{self.min_block}+{self.inner.describe()}"

    def accept(self, draft, num_draft, scores, tokens):
        m, bonus = self.inner.accept(draft, num_draft, scores, tokens)
        forced = num_draft.clamp(max=self.min_block)
        after = tokens.grid(scores.top1, -1).gather(1, forced[:, None])[:, 0]  # the top-1 after the forced prefix
        return torch.maximum(m, forced), torch.where(forced > m, after, bonus)
