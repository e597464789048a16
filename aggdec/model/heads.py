"""Blockwise parallel decoding's proposal heads (Stern, Shazeer, Uszkoreit 2018): k-1 residual FFNs
on the verifier's final decoder state, projected by the verifier's own output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        """h (N,D) -> (N, num, D) from the first `num` heads (default all; heads are independent)."""
        n = self.num_heads if num is None else num
        z = F.relu(torch.einsum("nd,kdh->nkh", h, self.fc1[:n]) + self.b1[:n])  # (N, n, hidden)
        # contiguous: einsum leaves a head-major layout, which the output projection reads several times slower
        return (h[:, None] + torch.einsum("nkh,khd->nkd", z, self.fc2[:n]) + self.b2[:n]).contiguous()
