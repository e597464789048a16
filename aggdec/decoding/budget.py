"""How many draft tokens a call should verify: drafting that turns itself off where it does not pay.

A draft token costs verifier work (and drafter work) whether or not it is accepted. `DraftBudget`
chooses, before each call, the draft length L that maximizes expected output tokens per second:

    tokens(L) = B * (1 + sum_{i<=L} q_i),   q_i = p_1 * ... * p_i
    seconds(L) = a + b * B + c * B * L + e * [L > 0]

p_i is the running acceptance rate of draft position i given that position i - 1 was accepted
(exponentially weighted counts over all rows), so q_i is the expected share of rows whose i-th
draft token is kept. a, b, c, e are fitted by least squares to the measured times of the last
`window` iterations of the loop (verifier call, acceptance and the drafter's work), with rows B and
drafted tokens D = B * L as features; the bonus token every call yields makes tokens(0) = B, plain
greedy decoding. L = 0 is chosen whenever drafting does not pay, and the drafters then skip their
own work too.

Exploration keeps the estimates alive: the first calls alternate the longest and the empty draft,
and every `explore_every`-th call later tries one token more than the chosen length (or none),
which also keeps the cost fit well-posed.
"""

from __future__ import annotations

import numpy as np
import torch


class DraftBudget:
    """Per-call draft lengths for the loop (see module docstring). `max_length`: the longest draft
    considered (the drafter's own limit applies too)."""

    LONGEST = 64
    """`max_length` for drafters without a limit of their own (IAD without a draft cap)."""

    def __init__(self, max_length: int = 64, *, window: int = 64, decay: float = 0.98, warmup: int = 8,
                 explore_every: int = 16):
        self.max_length = max_length
        self.window, self.decay, self.warmup, self.explore_every = window, decay, warmup, explore_every
        self.tried = np.zeros(max_length)  # weighted rows whose draft reached position i + 1
        self.kept = np.zeros(max_length)  # ... and kept it
        self.samples: list[tuple[float, float, float]] = []  # (rows, drafted tokens, seconds)
        self.calls = 0
        self.choice = max_length
        self.coef: np.ndarray | None = None

    def acceptance(self) -> np.ndarray:
        """p_i, i = 1..max_length, with a prior of 1/2 at positions never tried."""
        return (self.kept + 0.5) / (self.tried + 1.0)

    def observe(self, num_draft: torch.Tensor, accepted: torch.Tensor) -> None:
        """Acceptance of the call that just ran: (B,) drafted and kept tokens per row."""
        nd = num_draft.clamp(max=self.max_length).cpu().numpy()
        acc = np.minimum(accepted.cpu().numpy(), nd)
        pos = np.arange(1, self.max_length + 1)[None]
        reached = (pos <= nd[:, None]) & (pos <= acc[:, None] + 1)
        self.tried = self.decay * self.tried + reached.sum(0)
        self.kept = self.decay * self.kept + (pos <= acc[:, None]).sum(0)

    def record(self, rows: int, drafted: int, seconds: float) -> None:
        """The measured time of the call that just ran."""
        self.samples.append((rows, drafted, seconds))
        if len(self.samples) > self.window:
            self.samples.pop(0)
        self.calls += 1
        if len(self.samples) >= self.warmup and self.calls % 4 == 0:
            self._fit()

    def _fit(self) -> None:
        s = np.asarray(self.samples)
        rows, drafted, t = s[:, 0], s[:, 1], s[:, 2]
        x = np.stack([np.ones_like(rows), rows, drafted, (drafted > 0).astype(float)], axis=1)
        if len(set(drafted > 0)) < 2 or np.ptp(drafted) == 0:
            return  # no variation to tell the costs apart yet
        coef, *_ = np.linalg.lstsq(x, t, rcond=None)
        self.coef = np.maximum(coef, 0.0)

    def next_length(self, rows: int, limit: int) -> int:
        """The draft length for the next call of `rows` rows (at most `limit`, the drafter's)."""
        limit = min(limit, self.max_length)
        if limit <= 0 or rows <= 0:
            return 0
        if self.calls < self.warmup or self.coef is None:
            return limit if self.calls % 2 == 0 else 0
        a, b, c, e = self.coef
        q = np.cumprod(self.acceptance()[:limit])
        lengths = np.arange(limit + 1)
        tokens = rows * (1 + np.concatenate([[0.0], np.cumsum(q)]))
        seconds = a + b * rows + c * rows * lengths + e * (lengths > 0)
        best = int(np.argmax(tokens / np.maximum(seconds, 1e-9)))
        self.choice = best
        if self.calls % self.explore_every == 0:
            return min(best + 1, limit) if (self.calls // self.explore_every) % 2 else max(best - 1, 0)
        return best
