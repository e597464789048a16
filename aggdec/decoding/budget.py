"""How many draft tokens a call should verify: drafting that turns itself off where it does not pay.

A draft token costs verifier and drafter work whether or not it is accepted, and what a call costs
depends on the machine, the batch, the drafter and how often its drafts are right. So
`DraftBudget` measures the quantity it optimizes: for each draft length L it keeps exponentially
weighted sums of the output tokens committed and the wall-clock seconds spent (the whole loop
iteration: proposing, verifying, accepting, drafting, bookkeeping, refills) over calls made at that
length, and the next calls use the length with the most tokens per second. L = 0 is plain greedy
decoding, and is chosen whenever drafting does not pay; the drafters then skip their own work.

Lengths are measured in blocks of `block` consecutive calls. The first blocks measure the longest
draft and none; afterwards a block now and then tries one token more than the best length, or one
less, so the estimates follow the run. The interval between such blocks starts at `explore_every`
calls and doubles (up to `max_explore_every`) each time the length tried loses by more than 5%, so
a run where drafting does not pay spends almost nothing on finding that out again. A budget can be kept across runs of the same
options (`aggdec.api` does), so that later runs start from what earlier ones measured.
`acceptance()` reports the running acceptance rate of each draft position.
"""

from __future__ import annotations

import numpy as np
import torch


class DraftBudget:
    """Per-call draft lengths for the loop (see module docstring). `max_length`: the longest draft
    considered (the drafter's own limit applies too)."""

    LONGEST = 64
    """`max_length` for drafters without a limit of their own (IAD without a draft cap)."""

    def __init__(self, max_length: int = 64, *, block: int = 4, explore_every: int = 64,
                 max_explore_every: int = 2048, decay: float = 0.99):
        self.max_length = max_length
        self.block, self.decay = block, decay
        self.explore_every, self.min_explore, self.max_explore = explore_every, explore_every, max_explore_every
        self._next_explore, self._exploring, self._up = explore_every, False, True
        self.tokens = np.zeros(max_length + 1)  # weighted output tokens of calls at draft length L
        self.seconds = np.zeros(max_length + 1)  # ... and their seconds
        self.tried = np.zeros(max_length)  # weighted rows whose draft reached position i + 1
        self.kept = np.zeros(max_length)  # ... and kept it
        self.calls = 0
        self.choice = max_length
        self._current, self._left = max_length, block  # the length of the running block, calls left

    def acceptance(self) -> np.ndarray:
        """p_i, i = 1..max_length: the share of drafts reaching position i that kept it."""
        return (self.kept + 0.5) / (self.tried + 1.0)

    def observe(self, num_draft: torch.Tensor, accepted: torch.Tensor) -> None:
        """Acceptance of the call that just ran: (B,) drafted and kept tokens per row."""
        nd = num_draft.clamp(max=self.max_length).cpu().numpy()
        acc = np.minimum(accepted.cpu().numpy(), nd)
        pos = np.arange(1, self.max_length + 1)[None]
        self.tried = self.decay * self.tried + ((pos <= nd[:, None]) & (pos <= acc[:, None] + 1)).sum(0)
        self.kept = self.decay * self.kept + (pos <= acc[:, None]).sum(0)

    def record(self, length: int, tokens: int, seconds: float) -> None:
        """A call at draft length `length` committed `tokens` output tokens in `seconds`, all in."""
        self.calls += 1
        length = min(length, self.max_length)
        self.tokens *= self.decay
        self.seconds *= self.decay
        self.tokens[length] += tokens
        self.seconds[length] += seconds

    def rates(self) -> np.ndarray:
        """Output tokens per second at each length (NaN where not measured)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.seconds > 0, self.tokens / self.seconds, np.nan)

    def next_length(self, rows: int, limit: int) -> int:
        """The draft length for the next call (at most `limit`, the drafter's)."""
        limit = min(limit, self.max_length)
        if limit <= 0 or rows <= 0:
            return 0
        if self._left > 0:
            self._left -= 1
            return min(self._current, limit)
        rates = self.rates()[: limit + 1]
        if np.isnan(rates[limit]) or np.isnan(rates[0]):  # measure the longest draft, then none
            self._current = limit if np.isnan(rates[limit]) else 0
        else:
            best = int(np.nanargmax(rates))
            if self._exploring:  # the block just measured: keep exploring often only if it paid
                lost = rates[self._current] < 0.95 * rates[best] or np.isnan(rates[self._current])
                self.explore_every = min(2 * self.explore_every, self.max_explore) if lost else self.min_explore
                self._next_explore = self.calls + self.explore_every
                self._exploring = False
            self.choice = self._current = best
            if self.calls >= self._next_explore:
                self._up = not self._up
                self._current = min(best + 1, limit) if self._up else max(best - 1, 0)
                self._exploring = self._current != best
                self._next_explore = self.calls + self.explore_every
        self._left = self.block - 1
        return self._current
