"""Blockwise parallel decoding (Stern, Shazeer, Uszkoreit 2018): k-1 proposal heads on the verifier.

Head i (i = 1 .. k-1) maps the verifier's final decoder state h_t (which predicts token t+1 through
the model's own output projection) to a state predicting token t+1+i: h + FFN_i(h), one hidden
layer with a residual, then the verifier's (frozen) output projection.

Combined scoring and proposal (Section 4): the verification call that scores a block also yields
h at the bonus position, so the heads' proposals for the next block come from the same call; each
iteration is one verifier call plus k-1 small head FFNs on one position per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aggdec.decoding.metadata import DraftBatch
from aggdec.decoding.state import DecodeState
from aggdec.model.linear import linear
from aggdec.model.projection import draft_argmax
from aggdec.model.transformer import Transformer


class ProposalHeads(nn.Module):
    """k-1 residual FFN heads. forward(h (N,D)) -> states (N, k-1, D) for the output projection."""

    def __init__(self, d_model: int, num_heads: int, hidden: int):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"need at least one proposal head (block size k >= 2), got {num_heads}")
        self.fc1 = nn.Parameter(torch.empty(num_heads, d_model, hidden))
        self.b1 = nn.Parameter(torch.zeros(num_heads, hidden))
        self.fc2 = nn.Parameter(torch.zeros(num_heads, hidden, d_model))  # heads start as identity
        self.b2 = nn.Parameter(torch.zeros(num_heads, d_model))
        nn.init.normal_(self.fc1, std=d_model**-0.5)

    @property
    def num_heads(self) -> int:
        return self.fc1.shape[0]

    def forward(self, h: torch.Tensor, num: int | None = None) -> torch.Tensor:
        """h (N,D) -> (N, num, D) from the first `num` heads (default all). Heads are independent,
        so the first k-1 heads of a model trained with block size K >= k serve block size k."""
        n = self.num_heads if num is None else num
        z = F.relu(torch.einsum("nd,kdh->nkh", h, self.fc1[:n]) + self.b1[:n])  # (N, n, hidden)
        # einsum leaves a head-major layout; the output projection is 3x (fp32) to 170x (bf16)
        # slower on such a strided input, so return a contiguous tensor.
        return (h[:, None] + torch.einsum("nkh,khd->nkd", z, self.fc2[:n]) + self.b2[:n]).contiguous()


class BlockwiseHeads:
    """Drafter for the shared loop: the next draft is the heads' proposals from the last call.

    A row's first call drafts nothing (there is no verifier state yet); afterwards every call
    proposes k-1 tokens after the bonus token.
    """

    name = "blockwise"

    def __init__(self, verifier: Transformer, heads: ProposalHeads, block_size: int | None = None,
                 out_weight: torch.Tensor | None = None):
        """block_size k: propose k-1 tokens with the first k-1 heads (default and at most: all heads).
        out_weight (V, D): projects proposals (default: the verifier's); heads run in its dtype."""
        if block_size is not None and block_size < 2:
            raise ValueError(f"blockwise block size must be >= 2, got {block_size}")
        self.heads = heads
        self.out_weight = verifier.output_weight if out_weight is None else out_weight
        self.k1 = heads.num_heads if block_size is None else min(block_size - 1, heads.num_heads)
        self.pending: torch.Tensor | None = None  # (B, k-1) proposals for the next call
        self.ready: torch.Tensor | None = None  # (B,) bool: row has proposals

    def admit(self, state: DecodeState, slots: torch.Tensor) -> None:
        b, k1 = state.batch_size, self.k1
        if self.pending is None or self.pending.shape[0] != b or slots.numel() == b:
            self.pending = torch.full((b, k1), state.pad, dtype=torch.long, device=state.out.device)
            self.ready = torch.zeros(b, dtype=torch.bool, device=state.out.device)
        self.ready[slots] = False

    def select(self, rows: torch.Tensor) -> None:
        self.pending = self.pending.index_select(0, rows)
        self.ready = self.ready.index_select(0, rows)

    def propose(self, state: DecodeState) -> DraftBatch:
        num = torch.where(self.ready, self.k1, 0)
        if not bool(self.ready.any()):
            return DraftBatch.empty(state.batch_size, state.out.device, state.pad)
        return DraftBatch(tokens=self.pending.clone(), num_draft=num)

    @torch.no_grad()
    def observe(self, state, draft, accepted, hidden):
        logits = linear(self.heads(hidden.to(self.out_weight.dtype), self.k1), self.out_weight)  # (B, k-1, V)
        logits[..., state.pad] = -float("inf")
        self.pending = draft_argmax(logits)
        self.ready = torch.ones_like(self.ready)
