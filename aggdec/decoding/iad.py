"""IAD, input-guided aggressive decoding (Ge et al. 2022): the draft is a copy of the input.

For correction-like tasks, where the output mostly copies the input. Lossless: the output is greedy's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aggdec.decoding.drafters import RowState, adapt_length
from aggdec.decoding.metadata import DraftBatch
from aggdec.decoding.method_options import IADOptions
from aggdec.decoding.state import DecodeState
from aggdec.thresholds import IAD_MIN_DRAFT, MATCH_DEPTH

_BOS_MARK = -1  # stands for the decoder's start token and the input's start in suffix matching
_NO_TOKEN = -2  # source padding, matches nothing
_NO_MATCH = -3  # before the output's start, matches nothing


def _nearest(last: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """(B,) the candidate end position of `last` (B, S) bool nearest each row's anchor (B,), the
    later one on a tie."""
    i = torch.arange(last.shape[1], device=last.device)[None]
    dist = 2 * (i - anchor[:, None]).abs() - (i > anchor[:, None]).long()
    return dist.masked_fill(~last, last.shape[1] * 4).argmin(dim=1)


def _first_occurrence(state: DecodeState) -> torch.Tensor:
    """(B,) the x index of the first occurrence of each row's last output token in its input, or -1."""
    hit = state.src == state.last_tokens()[:, None]
    hit &= torch.arange(state.src.shape[1], device=hit.device)[None] < state.src_len[:, None]
    return torch.where(hit.any(dim=1), hit.long().argmax(dim=1) + 1, -1)


def _copy(state: DecodeState, start: torch.Tensor, num: torch.Tensor, width: int) -> DraftBatch:
    """Drafts (B, width): each row's `num` source tokens from x index `start`, pad after them."""
    offs = torch.arange(width, device=state.out.device)[None]
    tokens = state.src.gather(1, (start[:, None] - 1 + offs).clamp(0, state.src.shape[1] - 1))
    return DraftBatch(tokens=tokens.masked_fill(offs >= num[:, None], state.pad), num_draft=num)


class InputCopy:
    """IAD (Ge et al., Algorithm 1): draft the input's continuation after a unique suffix match.

    Let x = (BOS, x_1 .. x_n, eos) be the input and o = (BOS, o_1 .. o_j) the output so far. Find the
    smallest q >= 1 such that o's last q tokens occur in x at exactly one end position i; the draft is
    then x_{i+1} .. (at most `max_draft` tokens, None: no cap). At the start o = (BOS) matches x_0, so
    the first draft is the whole input. If the suffix occurs nowhere, the row drafts nothing.
    `adaptive`: each row's cap follows `adapt_length` between `min_draft` and `max_draft`.

    Beyond Algorithm 1, where it would draft nothing (docs/design.md, "IAD re-alignment"), right after
    a rejected draft token: `substitution` copies the input after that token; `nearest_match`, where the
    longest matching suffix occurs several times, re-aligns at the occurrence nearest to the input token
    after it. `skip_prefix`: once the output has its first token, re-align at its first occurrence in x.
    """

    name = "iad"
    from_states = False
    source_bound = True  # its drafts are copies of the source

    def __init__(self, max_draft: int | None = None, adaptive: bool = False, min_draft: int = IAD_MIN_DRAFT,
                 substitution: bool = False, nearest_match: bool = False, skip_prefix: bool = False):
        if max_draft is not None and max_draft < 1:
            raise ValueError(f"max_draft must be >= 1 or None, got {max_draft}")
        if adaptive and max_draft is None:
            raise ValueError("adaptive draft caps need max_draft")
        self.max_draft, self.adaptive = max_draft, adaptive
        self.min_draft = min(min_draft, max_draft) if max_draft else min_draft
        self.substitution, self.nearest_match, self.skip_prefix = substitution, nearest_match, skip_prefix
        # per row: cap (adaptive only); resume, the x index to copy from after a rejection, or -1;
        # start, the x index of the last draft's first token, or -1
        self.rows = RowState()

    @classmethod
    def from_options(cls, opts: IADOptions, ctx=None) -> "InputCopy":
        return cls(max_draft=opts.draft_cap, adaptive=opts.adaptive_draft, substitution=opts.substitution,
                   nearest_match=opts.nearest_match, skip_prefix=opts.skip_prefix)

    def admit(self, state, slots):
        self.rows.admit(state, slots, resume=-1, start=-1, **({"cap": self.max_draft} if self.adaptive else {}))

    def match(self, state: DecodeState, depth: int = MATCH_DEPTH, anchor: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) end position i in x of each row's unique suffix match, or -1 where there is none: one
        fixed-shape tensor program (no host reads) trying the output's suffixes of up to `depth` tokens
        (a unique suffix only longer counts as none). anchor (B,) x index or -1, optional: where a row's
        longest matching suffix occurs several times, the occurrence nearest to it (later on a tie)."""
        dev, q = state.out.device, torch.arange(depth, device=state.out.device)
        # x: the BOS mark at x index 0 (and at the depth - 1 places before it, which no suffix reaches: the
        # output's first token is no BOS mark), the source, NO_TOKEN past its length
        x = F.pad(state.src, (depth, 0), value=_BOS_MARK)
        x = x.masked_fill(torch.arange(x.shape[1], device=dev) >= depth + state.src_len[:, None], _NO_TOKEN)
        # windows[b, i, q] = x[b, i - (depth - 1 - q)] and tok[b, q], o's token depth - 1 - q from its end
        at = state.out_len[:, None] - depth + q
        tok = state.out.gather(1, at.clamp(min=0)).masked_fill(at == 0, _BOS_MARK).masked_fill(at < 0, _NO_MATCH)
        miss = x.unfold(1, depth, 1) != tok[:, None, :]  # (B, S, Q)
        # matched[b, i]: how many of o's last tokens end at i (its suffix of r + 1 tokens: where matched > r)
        matched = depth - 1 - torch.where(miss, q, -1).amax(dim=2)
        count = (matched[:, :, None] > q).sum(dim=1)  # (B, Q): end positions of each suffix, non-increasing in r
        unique = count == 1
        first = unique.to(torch.uint8).argmax(dim=1)  # the shortest unique suffix has first + 1 tokens
        pos = torch.where(unique.any(dim=1), (matched > first[:, None]).to(torch.uint8).argmax(dim=1), -1)
        if anchor is not None:
            several = (count > 1).sum(dim=1)  # the longest suffix that occurs more than once has this many tokens
            last = (matched >= several[:, None]) & (several > 0)[:, None]
            pos = torch.where((pos < 0) & (anchor >= 0) & (several > 0), _nearest(last, anchor), pos)
        return pos

    def _drafts(self, state: DecodeState, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From each row's match `pos` (B,) (-1: none), after the substitution fallback: the x index of
        its first draft token (-1: no draft) and its draft length under the row's cap."""
        rows = self.rows
        if self.skip_prefix:
            pos = torch.where((pos < 0) & (state.generated == state.stride), _first_occurrence(state), pos)
        if self.substitution:
            pos = torch.where((pos < 0) & (rows.resume >= 0), rows.resume - 1, pos)
        start = torch.where(pos >= 0, pos + 1, -1)  # x index i is src index i - 1
        num = torch.where(pos >= 0, state.src_len - pos, 0)
        if self.adaptive:
            num = torch.minimum(num, rows.cap)
        elif self.max_draft is not None:
            num = num.clamp(max=self.max_draft)
        return start, num.clamp(min=0)

    def observe(self, state, draft, accepted, verified):
        rows, num_draft = self.rows, draft.num_draft
        if self.substitution or self.nearest_match:
            # after rejecting draft token m (x index start+m), resume copying at start+m+1
            rejected = (accepted < num_draft) & (rows.start >= 0)
            rows.resume.copy_(torch.where(rejected, rows.start + accepted + 1, -1))
        if self.adaptive:
            rows.cap.copy_(adapt_length(rows.cap, num_draft, accepted, self.min_draft, self.max_draft))

    def propose(self, state, width):
        """Drafts (B, width): each row's input after its unique suffix match (`match`, `_drafts`, `_copy`)."""
        start, num = self._drafts(state, self.match(state, anchor=self.rows.resume if self.nearest_match else None))
        self.rows.start.copy_(start)
        return _copy(state, start, num, width)
