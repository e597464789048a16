"""T5's relative position bias: a learned scalar per head added to each self-attention score (none in
cross-attention), looked up by the bucket of the key's position relative to the query's. Buckets are
Mesh TensorFlow's (transformers' `T5Attention._relative_position_bucket`): distances below buckets / 2
(bidirectional, the encoder's: buckets / 4 on each side) get a bucket each, longer ones share
logarithmically wider buckets up to `max_distance`, from where they all share the last one; the
decoder's are causal (a key after the query has bucket 0, and is masked anyway).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_bucket(relative: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int) -> torch.Tensor:
    """The bucket (int64, same shape) of each relative position key - query in `relative` (int64)."""
    out = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        out += (relative > 0).long() * buckets
        relative = relative.abs()
    else:
        relative = -torch.clamp(relative, max=0)
    exact = buckets // 2
    large = exact + (torch.log(relative.float() / exact) / math.log(max_distance / exact)
                     * (buckets - exact)).long()
    large = torch.clamp(large, max=buckets - 1)
    return out + torch.where(relative < exact, relative, large)


class RelativeBias(nn.Module):
    """One table of T5's relative position bias: `weight` (buckets, heads), transformers'
    `relative_attention_bias.weight`; `buckets`, those of the distances -max_distance .. max_distance
    (farther ones share the bucket of max_distance)."""

    def __init__(self, buckets: int, heads: int, max_distance: int, bidirectional: bool):
        super().__init__()
        self.max_distance = max_distance
        self.weight = nn.Parameter(torch.empty(buckets, heads))
        nn.init.normal_(self.weight, std=heads**-0.5)
        distance = torch.arange(-max_distance, max_distance + 1)
        self.register_buffer("buckets", relative_bucket(distance, bidirectional, buckets, max_distance),
                             persistent=False)

    def index(self, query: torch.Tensor, keys: int) -> torch.Tensor:
        """(B, T, keys) rows of `buckets` for queries at positions `query` (B, T) int64 over key
        positions 0 .. keys - 1; shared by the tables of one stack (`relative_per_layer`)."""
        distance = torch.arange(keys, device=query.device)[None, None, :] - query[:, :, None]
        return distance.clamp(-self.max_distance, self.max_distance) + self.max_distance

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        """The bias (B, H, T, L) at `index` (B, T, L) from `index`; a view whose heads are not the
        last dimension (the attention kernel reads any strides)."""
        return self.weight[self.buckets[index]].permute(0, 3, 1, 2)
