"""GAD with a draft head (aggdec.model.draft_head): after each verifier call the head drafts each row's
next `block_size` tokens from the verifier's states of that call, in one non-autoregressive pass. A
row's first call drafts nothing (there is no verifier state yet).
"""

from __future__ import annotations

import weakref

import torch

from aggdec.decoding.drafters import StateDrafter, Verified
from aggdec.decoding.options import OptionError
from aggdec.decoding.state import DecodeState
from aggdec.model.draft_head import DraftHead
from aggdec.model.linear import linear, prepack
from aggdec.model.projection import draft_argmax
from aggdec.model.transformer import Transformer

_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""head -> {(id of verifier, id of output weight): (verifier, output weight, `_prepared`'s result)};
holding the verifier and output weight keeps their ids theirs."""


def _prepared(verifier: Transformer, head: DraftHead, out_weight: torch.Tensor | None):
    """(the head's draft-vocabulary output weight, its oneDNN packing, the verifier's output bias on it
    or None), built once per head, verifier and output weight."""
    key = (id(verifier), None if out_weight is None else id(out_weight))
    cache = _PREPARED.setdefault(head, {})
    if key not in cache:
        dtype = next(head.parameters()).dtype
        weight, bias = verifier.output_weight if out_weight is None else out_weight, verifier.output_bias
        rows = head.vocab if head.cfg.draft_vocab else slice(None)
        weight = weight[rows].detach().to(dtype).contiguous()
        bias = None if bias is None else bias[rows].detach().to(dtype)
        cache[key] = (verifier, out_weight, (weight, prepack(weight), bias))
    return cache[key][2]


class DraftHeadDrafter(StateDrafter):
    """Drafter for the shared loop (`StateDrafter`); `block_size` (at most the head's) tokens per call.
    out_weight (V, D): the output projection to draft with (default: the verifier's), in the head's
    dtype; only the head's draft vocabulary rows are used."""

    name = "gad"

    def __init__(self, verifier: Transformer, head: DraftHead, block_size: int | None = None,
                 out_weight: torch.Tensor | None = None):
        super().__init__(head.cfg.block_size if block_size is None else min(block_size, head.cfg.block_size))
        self.head = head
        self.weight, self.packed, self.bias = _prepared(verifier, head, out_weight)
        self.decoder = verifier.decoder  # its token embeddings: the head's token half of each context
        self.last_layer = len(verifier.decoder.layers) - 1
        self.vocab = head.vocab if head.cfg.draft_vocab else None

    @classmethod
    def from_options(cls, opts, ctx) -> "DraftHeadDrafter":
        """The head of `opts.drafter` on the verifier of `ctx` (a methods.DraftContext)."""
        head = ctx.load(opts.drafter, ctx.bf16)
        if not isinstance(head, DraftHead):
            raise OptionError("drafter", f"{opts.drafter}: not a draft head (gad and gad++ draft with a head "
                                         "trained by `python -m aggdec.train.draft_head`)")
        return cls(ctx.model, head, opts.block_size,
                   out_weight=ctx.projection.draft_weight_bf16 if ctx.bf16 else None)

    def _draft(self, state: DecodeState, verified: Verified, k: int) -> torch.Tensor:
        """(B, k) drafts from each row's verifier state behind its last token and the verifier's last
        layer's self- and cross-attention keys/values (`Verified`)."""
        pk, pv, lengths, ck, cv, src_pad = verified.keys(self.last_layer)
        dtype = self.weight.dtype
        dec = self.decoder
        emb = (dec.embed_scale * dec.embed_tokens.weight[state.last_tokens()]).to(dtype)
        ctx = self.head.context(verified.hidden.to(dtype), emb)
        keep = torch.arange(pk.shape[1], device=pk.device)[None] < lengths[:, None]
        states = self.head.from_context(ctx, pk.to(dtype), pv.to(dtype), keep, ck.to(dtype), cv.to(dtype), src_pad, k)
        logits = linear(states, self.weight, self.bias, packed=self.packed)  # (B, k, V_draft)
        if self.vocab is None:
            logits[..., state.pad] = -float("inf")
        ids = draft_argmax(logits)
        return ids if self.vocab is None else self.vocab[ids]
