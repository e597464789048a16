"""Acceptance criteria: how many draft tokens the verifier keeps, and what it adds after them.

Glossary (per row, one verifier call on [last token ; d_1 .. d_n]):
- verifier prediction p_t: the verifier's choice for the token after position t (t = 0..n).
- accepted tokens: the longest prefix d_1 .. d_m of the draft that the criterion keeps.
- bonus token: the verifier's p_m, appended after the accepted tokens. It exists even when the
  whole draft is accepted, so every call makes progress (it plays the role of the paper's
  [PAD] sentinel that guarantees a bifurcation).
The row commits d_1 .. d_m, p_m: m + 1 tokens.

`ExactMatch` (top-1) keeps the output identical to greedy decoding. `TopKTolerance` is GAD++.
Criteria read the verifier through `VerifierScores`: top-1 only (cheap, possibly certified bf16)
or full logits (computed in fp32 on first use). One definition of each rule serves both layouts of
the loop's step: an eager step's packed positions (`valid` a mask) and a fixed-shape step's (`valid`
None: every position of every slot, `FixedScores`, no host reads).
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Protocol

import torch

from aggdec.model.projection import Constrain, OutputProjection


def constrain_logits(logits: torch.Tensor, out_index: torch.Tensor, max_len: torch.Tensor, pad: int, eos: int,
                     min_len: int = 1, forced: torch.Tensor | None = None, fixed: bool = False) -> torch.Tensor:
    """Apply fairseq-generate's per-step rules, in place, to verifier logits.

    logits (..., V); out_index (...) int64 is the output index each position predicts (0 = first
    target token); max_len (...) the row's limit at each position. Rules: pad is never produced;
    eos is forbidden before `min_len` tokens; at index max_len only eos is allowed. forced (F,)
    int64, optional: the token at output index i < F is forced[i] (a model's forced first tokens,
    aggdec.conventions), with logit 0 and every other token -inf, as Hugging Face's forced-token
    logits processors. fixed: no host reads (every rule applied without asking whether a position
    needs it: the slot loop's step).
    """
    neg = -math.inf
    logits[..., pad] = neg
    if min_len > 0:
        logits[..., eos].masked_fill_(out_index < min_len, neg)
    force = out_index >= max_len  # (...)
    if fixed or bool(force.any()):
        eos_col = logits[..., eos].clone()
        logits.masked_fill_(force[..., None], neg)
        logits[..., eos] = torch.where(force, eos_col, logits[..., eos])
    if forced is not None and forced.numel():
        at = out_index < forced.numel()
        if fixed or bool(at.any()):
            token = forced[out_index.clamp(max=forced.numel() - 1)]  # (...)
            logits.masked_fill_(at[..., None], neg)
            logits.scatter_(-1, token[..., None], torch.where(at, 0.0, logits.gather(-1, token[..., None])[..., 0])[..., None])
    return logits


def constrained_top1(logits: torch.Tensor, out_index: torch.Tensor, max_len: torch.Tensor, pad: int, eos: int,
                     min_len: int = 1, forced: torch.Tensor | None = None) -> torch.Tensor:
    """The argmax (...) of `logits` (..., V) under `constrain_logits`' rules, with no host reads (a
    fixed-shape program, for the slot loop): pad and early eos are masked in the logits (in place),
    the length limit and forced tokens override the argmax instead of rewriting whole rows."""
    logits[..., pad] = -math.inf
    if min_len > 0:
        logits[..., eos].masked_fill_(out_index < min_len, -math.inf)
    pred = torch.where(out_index >= max_len, eos, logits.argmax(dim=-1))
    if forced is not None and forced.numel():
        pred = torch.where(out_index < forced.numel(), forced[out_index.clamp(max=forced.numel() - 1)], pred)
    return pred


class VerifierScores:
    """The verifier's scores at the N verified positions (the valid positions, row-major).

    top1 (N,) int64: the argmax of the constrained fp32 logits, exactly (certified bf16 or fp32,
    as `projection` decides). logits (N, V) fp32: the constrained logits, computed on first use.
    `shape` (B, T), where N = B * T: both in that layout, as `FixedScores`' (every position of every row).
    """

    def __init__(self, projection: OutputProjection | None, hidden: torch.Tensor | None,
                 constrain: Constrain | None, logits: torch.Tensor | None = None,
                 shape: tuple[int, int] | None = None):
        self.projection, self.hidden, self.constrain, self.shape = projection, hidden, constrain, shape
        if logits is not None:
            self.logits = logits  # fills the cached property

    @classmethod
    def of(cls, logits: torch.Tensor) -> "VerifierScores":
        """Scores over given constrained logits (N, V)."""
        return cls(None, None, None, logits)

    @cached_property
    def logits(self) -> torch.Tensor:
        z = self.projection.logits(self.hidden)
        self.constrain(z, None)
        return z if self.shape is None else z.view(*self.shape, -1)

    @cached_property
    def top1(self) -> torch.Tensor:
        if "logits" in self.__dict__:  # already computed (GAD++): their argmax is free
            return self.logits.argmax(dim=-1)
        top1 = self.projection.top1(self.hidden, self.constrain)
        return top1 if self.shape is None else top1.view(self.shape)


class FixedScores:
    """`VerifierScores` at every position of every slot, with no host reads (the slot loop's step): logits
    (B, T, V), fp32 (float64 for a float64 verifier) whatever the verifier's precision, so that the top-1
    is the one an eager step takes at any batch shape, constrained in place on first use; top1 (B, T) by
    `constrained_top1` unless they were. `rules`: `constrain_logits`' arguments after the logits. Memoized
    by hand (TorchDynamo breaks at `cached_property`)."""

    def __init__(self, logits: torch.Tensor, *rules):
        self.raw, self.rules, self._logits, self._top1 = logits, rules, None, None

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = constrain_logits(self.raw, *self.rules, fixed=True)
        return self._logits

    @property
    def top1(self) -> torch.Tensor:
        if self._top1 is None:
            self._top1 = (constrained_top1(self.raw, *self.rules) if self._logits is None
                          else self._logits.argmax(dim=-1))
        return self._top1


class Acceptance(Protocol):
    def describe(self) -> str:
        """The rule and its parameters, for output signatures."""

    def accept(self, draft: torch.Tensor, num_draft: torch.Tensor, scores: VerifierScores,
               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide per row.

        draft (B,K) int64; num_draft (B,); valid (B,K+S) bool, True at positions t < num_draft[b] + S,
        S being the verifier's tokens per step (1; 2 for a double-token model, whose bonus is the pair
        at positions m, m + 1); scores: the verifier at the valid positions in row-major order
        (N = valid.sum()); position t predicts the token after draft token t (t = 0: after the last).
        valid None: scores at every position (B, K+S), and no host reads (`FixedScores`).
        Returns (accepted (B,) int64, bonus (B,) int64).
        """


def unpack(values: torch.Tensor, valid: torch.Tensor | None, fill) -> torch.Tensor:
    """Scatter packed per-position values (N, ...) back to valid's layout (B, K+S, ...), `fill` elsewhere
    (valid None: values already in that layout, returned as they are)."""
    if valid is None:
        return values
    out = values.new_full((*valid.shape, *values.shape[1:]), fill)
    out[valid] = values
    return out


def _prefix_len(ok: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in ok (B,K), limited to num_draft."""
    k = ok.shape[1]
    valid = torch.arange(k, device=ok.device)[None] < num_draft[:, None]
    return torch.cumprod((ok & valid).long(), dim=1).sum(dim=1)


class ExactMatch:
    """Accept a draft token iff it is the verifier's argmax (lossless)."""

    name = "exact"

    def describe(self) -> str:
        return self.name

    def accept(self, draft, num_draft, scores, valid):
        pred = unpack(scores.top1, valid, -1)  # (B, K+S)
        m = _prefix_len(pred[:, : draft.shape[1]] == draft, num_draft)
        return m, pred.gather(1, m[:, None]).squeeze(1)


class TopKTolerance:
    """GAD++: accept d_t if it is in the verifier's top-`beta` and log p(top1) - log p(d_t) <= `tau`.

    With beta=1 this is ExactMatch. The bonus token is the verifier's top-1. A call in which no row
    drafted reads the top-1 alone, as ExactMatch does (greedy steps under a draft budget cost what
    greedy's do).
    """

    name = "topk"

    def __init__(self, beta: int, tau: float):
        if beta < 1:
            raise ValueError(f"top-beta must be >= 1, got {beta}")
        if tau < 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        self.beta, self.tau = beta, tau

    def describe(self) -> str:
        return f"top{self.beta}-tau{self.tau}"

    def accept(self, draft, num_draft, scores, valid):
        # nothing to check (a plain greedy step): top-1 without full logits
        if draft.shape[1] == 0 or (valid is not None and not bool((num_draft > 0).any())):
            return ExactMatch().accept(draft, num_draft, scores, valid)
        logp = torch.log_softmax(scores.logits.float(), dim=-1)  # (N, V) or (B, K+1, V)
        top = logp.topk(self.beta, dim=-1)
        # the token each position would be checked against: the next draft token (or none)
        s = (logp.shape[1] if valid is None else valid.shape[1]) - draft.shape[1]
        nxt = torch.nn.functional.pad(draft, (0, s), value=-1)
        nxt = nxt if valid is None else nxt[valid]
        in_top = (top.indices == nxt[..., None]).any(-1)
        gap = top.values[..., 0] - logp.gather(-1, nxt.clamp(min=0)[..., None])[..., 0]
        ok = unpack(in_top & (gap <= self.tau) & gap.isfinite(), valid, False)[:, : draft.shape[1]]  # never a -inf
        pred = unpack(top.indices[..., 0], valid, -1)
        m = _prefix_len(ok, num_draft)
        return m, pred.gather(1, m[:, None]).squeeze(1)


class MinBlock:
    """Stern et al.'s minimum block size (approximate): always keep the first `min_block` draft
    tokens (as far as drafted), then apply `inner` to decide the rest of the prefix."""

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

    def accept(self, draft, num_draft, scores, valid):
        m, bonus = self.inner.accept(draft, num_draft, scores, valid)
        forced = num_draft.clamp(max=self.min_block)
        after = unpack(scores.top1, valid, -1).gather(1, forced[:, None])[:, 0]  # the top-1 after the forced prefix
        return torch.maximum(m, forced), torch.where(forced > m, after, bonus)
