"""Blockwise parallel decoding (Stern, Shazeer, Uszkoreit 2018): k-1 proposal heads on the verifier
(aggdec.model.heads). Head i maps the verifier's final decoder state h_t, which predicts token t+1, to
a state predicting token t+1+i; the verification call that scores a block also yields h at the bonus
position, so the next block's proposals come from the same call (combined scoring and proposal).
"""

from __future__ import annotations

import torch

from aggdec.decoding.drafters import StateDrafter, Verified
from aggdec.decoding.method_options import BlockwiseOptions
from aggdec.decoding.state import DecodeState
from aggdec.model.heads import ProposalHeads
from aggdec.model.linear import linear
from aggdec.model.projection import draft_argmax
from aggdec.model.transformer import Transformer


class BlockwiseHeads(StateDrafter):
    """Drafter for the shared loop: the next draft is the heads' proposals from the last call, k-1
    tokens after the bonus token (`StateDrafter`)."""

    name = "blockwise"

    def __init__(self, verifier: Transformer, heads: ProposalHeads, block_size: int | None = None,
                 out_weight: torch.Tensor | None = None):
        """block_size k: propose k-1 tokens with the first k-1 heads (default and at most: all heads).
        out_weight (V, D): projects proposals (default: the verifier's); heads run in its dtype."""
        if block_size is not None and block_size < 2:
            raise ValueError(f"blockwise block size must be >= 2, got {block_size}")
        super().__init__(heads.num_heads if block_size is None else min(block_size - 1, heads.num_heads))
        self.heads = heads
        self.out_weight = verifier.output_weight if out_weight is None else out_weight
        bias = verifier.output_bias  # Marian/BART's final_logits_bias, in the proposals' dtype
        self.out_bias = None if bias is None else bias.detach().to(self.out_weight.dtype)

    @classmethod
    def from_options(cls, opts: BlockwiseOptions, ctx) -> "BlockwiseHeads":
        """The heads of `opts.drafter` on the verifier of `ctx` (a methods.DraftContext)."""
        return cls(ctx.model, ctx.load(opts.drafter, ctx.bf16), opts.block_size,
                   out_weight=ctx.projection.draft_weight_bf16 if ctx.bf16 else None)

    def _draft(self, state: DecodeState, verified: Verified, k: int) -> torch.Tensor:
        """The first k heads' proposals (only the heads of the next call's draft run)."""
        hidden = verified.hidden.to(self.out_weight.dtype)
        logits = linear(self.heads(hidden, k), self.out_weight, self.out_bias)  # (B, k, V)
        logits[..., state.pad] = -float("inf")
        return draft_argmax(logits)
