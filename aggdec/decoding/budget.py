"""How many draft tokens a call should verify: drafting that turns itself off where it does not pay
(docs/design.md, "Drafting that pays or turns itself off"). `DraftBudget` measures output tokens per
second of loop iterations (not the encoding of refills) in blocks of calls and picks the draft length
with the most, 0 (plain greedy) included; a challenger length's block is compared with the best-length
blocks just before and after it. A cold budget's first drafting trial adds at most `DRAFT_PROBE` positions
to a call (64 tokens a row at batch 1, one at 64 rows); drafting grows fourfold from there while drafts
land and longer ones win at this model's measured rates; a trial from none whose drafts never land ends
once it drafted over a few rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from aggdec.thresholds import (DRAFT_EVIDENCE, DRAFT_EXPLORE, DRAFT_LANDED, DRAFT_LONGEST, DRAFT_PROBE, DRAFT_RAMP,
                               DRAFT_WARM)

UNKNOWN_OFFER = 1 << 30
"""`Block.longest` where the drafts offered are unknown: as if every draft had been cut."""


class Block(NamedTuple):
    """A measured block of calls: output tokens per second, the fewest and most rows of its calls,
    the longest draft any of its calls was offered (before the length cap), its seconds, and the share of
    its drafted tokens accepted (0 where unknown)."""

    rate: float
    fewest: int
    most: int
    longest: int = UNKNOWN_OFFER
    seconds: float = 0.0
    landed: float = 0.0


class DraftBudget:
    """Per-call draft lengths for the loop, which calls `next_length` before each call and `record`
    after it. `max_length`: the longest draft considered (the drafter's own limit applies too).
    `block`: calls per block; `row_calls`: a block of a wide batch ends once its calls covered this
    many rows. Can be kept across runs of the same options (`aggdec.api` does)."""

    def __init__(self, max_length: int = DRAFT_LONGEST, *, block: int = 16, row_calls: int = 128, max_gap: int = 32):
        self.max_length = max_length
        self.block, self.row_calls, self.max_gap = block, row_calls, max_gap
        self.choice = 0  # the best length so far: a cold budget starts on the plain path
        self._drafting = max_length  # a challenger of none: the last choice that drafted (a cold one: `_close`)
        self._ramp = False  # the choice took over from a shorter length, its drafts landing: its longer
        # challenger is DRAFT_RAMP times it
        self.score: dict[int, float] = {}  # challenger -> running log(rate / rate of choice)
        self._gap, self._since, self._turn = 1, 1, 0  # challenger blocks every _gap best blocks
        self._owed = 0.0  # seconds of best-length blocks to run before the next challenger (`DRAFT_EXPLORE`)
        self._current = 0  # the length of the block being measured
        self._tokens = self._seconds = 0.0
        self._count = self._judged = 0
        self._drafted = self._accepted = 0  # draft tokens the block's calls verified, and of them accepted
        self._evidence = 0  # rows of the block's calls that drafted
        self._rows = (0, 0)  # fewest and most rows of the block's calls
        self._longest = 0  # the longest draft offered to the block's calls
        self._widest = 0  # the most rows of any call so far
        self._before: Block | None = None  # the last best-length block
        self._pending: tuple[int, Block, Block | None] | None = None  # (challenger, its block, the one before)
        self._alike: set[int] = set()  # challengers that drafted as the choice does (`_close`)
        self.calls = self.drafting_calls = 0  # calls recorded, and those at a draft length above 0

    def next_length(self, rows: int, limit: int) -> int:
        """The draft length for the next call (at most `limit`, the drafter's)."""
        return 0 if limit <= 0 or rows <= 0 else min(self._current, limit, self.max_length)

    def record(self, length: int, tokens: int, seconds: float, rows: int = 1, offered: int | None = None,
               drafted: int | None = None, accepted: int | None = None) -> None:
        """A call at draft length `length` over `rows` rows committed `tokens` output tokens in
        `seconds`; `offered`: the longest draft proposed for it before the length cap; `drafted`, `accepted`:
        the draft tokens it verified and accepted (None: unknown). Calls at another length than the current
        block's are not measured (they are counted). A drafting challenger of none that drafted over
        `DRAFT_EVIDENCE` rows (the rows of its calls that drafted) and accepted none has lost (its calls
        commit what none's do, at more cost): its block ends there."""
        self.calls += 1
        self.drafting_calls += length > 0
        if min(length, self.max_length) != self._current:
            return
        self._tokens += tokens
        self._seconds += seconds
        self._rows = (min(self._rows[0], rows) if self._count else rows, max(self._rows[1], rows))
        offered = UNKNOWN_OFFER if offered is None else offered
        self._longest = max(self._longest, offered) if self._count else offered
        self._widest = max(self._widest, rows)
        self._count += 1
        if drafted is not None and accepted is not None:
            self._drafted, self._accepted = self._drafted + drafted, self._accepted + accepted
            self._evidence += rows if drafted else 0
        lost = self.choice == 0 < self._current and self._evidence >= DRAFT_EVIDENCE and not self._accepted
        if lost or self._count >= self._block_length():
            block = Block(self._tokens / max(self._seconds, 1e-9), *self._rows, self._longest, self._seconds,
                          self._accepted / max(self._drafted, 1))
            self._tokens, self._seconds, self._count = 0.0, 0.0, 0
            self._drafted = self._accepted = self._evidence = 0
            self._current = self._lost(self._current, block) if lost else self._close(self._current, block)

    def describe(self) -> str:
        """Why the budget drafts as it does, in words: its choice and what each length tried against it
        measured ("no draft; 16 tokens measured 0.74x its output tokens/s"), or that it is still warming up."""
        def name(length: int) -> str:
            return f"{length} token{'s' if length > 1 else ''} a row" if length else "no draft"

        if not self.score:
            return f"{name(self.choice)}, nothing measured against it yet"
        tried = ", ".join(f"{name(x)} measured {math.exp(s):.2f}x its output tokens/s"
                          for x, s in sorted(self.score.items()) if x != self.choice)
        return f"{name(self.choice)}" + (f"; {tried}" if tried else "")

    def _block_length(self) -> int:
        """Calls per block: `block`, fewer on wide batches (at least `row_calls` row-calls and 2 calls);
        a quarter of that while warming up or ramping (`DRAFT_RAMP`), a half for challengers (most lose)."""
        full = max(2, min(self.block, math.ceil(self.row_calls / max(self._rows[1], 1))))
        if self._judged < DRAFT_WARM or self._ramp:
            return max(1, full // 4)
        return full if self._current == self.choice else max(1, full // 2)

    def _close(self, length: int, block: Block) -> int:
        """A block at `length` was measured: update the comparison, return the next block's length."""
        if length != self.choice:  # a challenger block: judged after the next best-length block
            self._pending = (length, block, self._before)
            return self.choice
        if self._pending is not None:  # the block after a challenger
            challenger, c, before = self._pending
            self._pending = None
            pair = [block] if before is None else [before, block]
            # dropped where the two lengths drafted alike (no draft offered longer than both allow: from none,
            # none offered at all) or the batch changed size (a drain changes the rate)
            if challenger and c.longest <= min(challenger, self.choice):
                self._alike.add(challenger)
                if self.choice == 0:  # offered nothing: its drafter's work was for nothing, tried later
                    self._gap = min(2 * self._gap, self.max_gap)
            elif max(b.most for b in [c, *pair]) <= 1.25 * min(b.fewest for b in [c, *pair]):
                rate = sum(b.rate for b in pair) / len(pair)
                if self._judge(challenger, math.log(c.rate / rate), c.landed):
                    return self.choice
                self._owe(c, rate)
        self._owed -= block.seconds
        self._before = block
        self._alike = {x for x in self._alike if block.longest < min(x, self.choice)}
        if (self._since >= self._gap and self._owed <= 0
                and 1.25 * block.fewest >= self._widest):  # not while a batch drains
            if self.choice == 0 and not self._judged:  # cold: the first drafting trial's tokens a row
                self._drafting = min(self._drafting, max(1, DRAFT_PROBE // max(self._widest, 1)))
            challengers = self._challengers()
            if challengers:
                self._since = 0
                untried = [c for c in challengers if c not in self.score]
                if untried:  # none first: the plain path is the one never to lose to
                    return untried[0]
                self._turn += 1
                return challengers[(self._turn - 1) % len(challengers)]
        self._since += 1
        return self.choice

    def _lost(self, challenger: int, c: Block) -> int:
        """A challenger of none drafted and accepted nothing in block `c`: judged now, as losing by far (its
        measured ratio to the last best-length block, at most 0.8), and the time it lost owed (`_owe`, a
        fifth of its block at least); the next block is none's."""
        rate = c.rate if self._before is None else self._before.rate
        self._judge(challenger, min(math.log(c.rate / rate), math.log(0.8)), 0.0)
        self._owe(c, rate, least=0.2)
        return self.choice

    def _owe(self, c: Block, rate: float, least: float = 0.0) -> None:
        """A challenger's block `c` lost against `rate`: the best length runs `DRAFT_EXPLORE` times the time
        it lost (at least a `least` share of its block) before the next challenger."""
        self._owed = DRAFT_EXPLORE * c.seconds * max(least, 1.0 - c.rate / rate)

    def _judge(self, challenger: int, log_ratio: float, landed: float) -> bool:
        """Update the challenger's score (`landed`: the share of its block's drafted tokens accepted); True if
        it took over."""
        self._judged += 1
        old = self.score.get(challenger)
        s = log_ratio if old is None else (old + log_ratio) / 2
        if s > 0:  # the challenger is ahead: it becomes the choice, compared with the old one
            self._drafting = self.choice or self._drafting
            self._ramp = self.choice < challenger < self.max_length and landed >= DRAFT_LANDED
            self.score = {self.choice: -s}
            self.choice, self._gap, self._since, self._before = challenger, 1, 1, None
            self._alike, self._owed = set(), 0.0
            return True
        self.score[challenger] = s
        self._ramp = self._ramp and challenger < self.choice
        if s < math.log(0.95):  # lost: try it again later, much later if it lost by far
            self._gap = min((4 if s < math.log(0.8) else 2) * self._gap, self.max_gap)
            if self.choice == 0 and challenger == self._drafting:  # from none, the next drafting trial: RAMP
                # times as long where drafts landed and lost narrowly (a cost a call that longer drafts share),
                # else a quarter as long
                self._drafting = (min(self.max_length, DRAFT_RAMP * challenger)
                                  if landed >= DRAFT_LANDED and s >= math.log(0.8) else max(1, challenger // 4))
        else:
            self._gap = 1
        return False

    def _challengers(self) -> list[int]:
        """None, a step less and a step more (a quarter of the current length, at least one token; `DRAFT_RAMP`
        times it first while the choice ramps); from none, first the last length that drafted (a cold budget's:
        `DRAFT_PROBE` tokens over the rows; `_judge` sets it after each loss). Not those set aside as drafting
        alike."""
        c = self.choice
        step = max(1, c // 4)
        lengths = (self._drafting, 0, c + step) if c == 0 else (
            (DRAFT_RAMP * c, 0, c - step) if self._ramp else (0, c - step, c + step))
        return list(dict.fromkeys(min(x, self.max_length) for x in lengths
                                  if 0 <= x and min(x, self.max_length) != c and x not in self._alike))
