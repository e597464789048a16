"""Data passed between the loop, drafters and acceptance criteria."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftBatch:
    """Drafts of the loop's rows: tokens (B, K) int64, row b's draft in tokens[b, :num_draft[b]];
    num_draft (B,) int64, each row's draft length (it may pass K: the loop cuts it there)."""

    tokens: torch.Tensor
    num_draft: torch.Tensor


@dataclass
class Request:
    """One sentence to decode. src: token ids ending in eos; max_len: most tokens before the forced eos."""

    index: int
    src: list[int]
    max_len: int


@dataclass
class RowStats:
    """Per-sentence decoding statistics. iterations: verifier calls that included this row; drafted:
    draft tokens proposed; accepted: draft tokens accepted and kept (not the verifier's own token, nor
    drafts after an accepted eos: iterations + accepted is len(tokens) + 1 or + 2 for a single-token
    model), accepted_per_iter: at each call; decode_ms: this row's share of the verifier and drafter
    time, split between the rows of each call in proportion to tokens fed."""

    iterations: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_iter: list[int] = field(default_factory=list)
    decode_ms: float = 0.0


@dataclass
class Hypothesis:
    """A finished row: output tokens (eos excluded), statistics."""

    index: int
    tokens: list[int]
    stats: RowStats


@dataclass
class BeamHypothesis(Hypothesis):
    """A beam search result: `tokens`, the best finalized hypothesis, and `score`, its normalized score
    (cumulative log-prob incl. eos / len ** lenpen, len counting the eos). nbest: the best `nbest`
    finalized hypotheses as (tokens without eos/pad, score), best first, nbest[0] = (tokens, score);
    fewer where fewer were finalized."""

    score: float = 0.0
    nbest: list[tuple[list[int], float]] = field(default_factory=list)
