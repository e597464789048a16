"""The batch of active rows that the draft -> verify loop works on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aggdec.decoding.metadata import Request, RowStats
from aggdec.model.cache import DecoderCache

NO_LIMIT = 1 << 30


@dataclass
class DecodeState:
    """Active rows ("slots"). All tensors have B rows on the model's device.

    src:     (B, S) int64 source ids incl. final eos, right-padded with pad.
    src_len: (B,) int64.
    out:     (B, Lo) int64 decoder inputs: out[b, :stride] = the decoder start (eos for fairseq; the pair
             (bos, start) for a double-token model), then generated tokens.
    out_len: (B,) int64; out[b, :out_len[b]] is valid. Generated tokens so far: out_len - stride.
    max_len: (B,) int64; the token at output index max_len is forced to eos.
    cache:   the verifier's decoder cache; invariant cache.lengths == out_len - stride between calls
             (every decoder input but the last step's has been fed).
    requests, stats: host-side, one per row, same order.
    pad, eos: the vocabulary's special ids.
    budget:  the most draft tokens any row's next call verifies, the same for every row (the loop's
             DraftBudget; NO_LIMIT when the loop has none). Drafters may skip work beyond it.
    stride:  tokens the verifier emits per step: 1, or 2 for a double-token model (aggdec.double_token),
             whose generated tokens are a folded stream of (head, tail) pairs.
    """

    src: torch.Tensor
    src_len: torch.Tensor
    out: torch.Tensor
    out_len: torch.Tensor
    max_len: torch.Tensor
    cache: DecoderCache
    requests: list[Request]
    stats: list[RowStats]
    pad: int
    eos: int
    budget: int = NO_LIMIT
    stride: int = 1

    @property
    def batch_size(self) -> int:
        return self.out_len.shape[0]

    @property
    def generated(self) -> torch.Tensor:
        """(B,) number of generated tokens per row."""
        return self.out_len - self.stride

    def next_draft(self, most: int) -> int:
        """The longest draft any row's next call verifies, at most `most` (0: the next call drafts
        nothing, so a drafter can skip its work)."""
        return min(most, self.budget) if self.batch_size else 0

    def last_tokens(self) -> torch.Tensor:
        """(B,) the last decoder input of each row (not yet fed to the verifier)."""
        return self.out.gather(1, (self.out_len - 1)[:, None]).squeeze(1)

    def last_step(self) -> torch.Tensor:
        """(B, stride) the decoder inputs of each row's last step (not yet fed to the verifier)."""
        offs = torch.arange(self.stride, device=self.out.device) - self.stride
        return self.out.gather(1, self.out_len[:, None] + offs)

    def reserve_out(self, extra: int) -> None:
        """Room in `out` for `extra` more tokens a row, between calls: the longest row's out_len is the
        cache's longest length + stride (the invariant above), which the cache keeps on the host."""
        need = self.cache.longest + self.stride + extra
        if need > self.out.shape[1]:
            grow = max(need, 2 * self.out.shape[1]) - self.out.shape[1]
            self.out = torch.nn.functional.pad(self.out, (0, grow), value=self.pad)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (finished rows leave the batch)."""
        keep = rows.tolist()
        self.src = self.src.index_select(0, rows)
        self.src_len = self.src_len.index_select(0, rows)
        self.out = self.out.index_select(0, rows)
        self.out_len = self.out_len.index_select(0, rows)
        self.max_len = self.max_len.index_select(0, rows)
        self.cache.select(rows)
        self.requests = [self.requests[i] for i in keep]
        self.stats = [self.stats[i] for i in keep]
