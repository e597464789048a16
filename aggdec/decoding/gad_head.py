"""GAD with a draft head (aggdec.model.draft_head): the next draft comes out of the current call.

After each verifier call the head reads, per row, the verifier's final state behind the bonus
token, the bonus token and the verifier's last-layer self- and cross-attention keys/values (its
cache), and proposes the next `block_size` tokens in one non-autoregressive pass. A row's first call drafts nothing (there
is no verifier state yet); afterwards every call verifies the head's block. An iteration is one
verifier call plus the head on k + 1 positions per row: no second encoder, no second decoder.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from aggdec.decoding.acceptance import Acceptance, ExactMatch, MinBlock, TopKTolerance
from aggdec.decoding.drafters import RowState
from aggdec.decoding.metadata import DraftBatch
from aggdec.decoding.options import DecodeOptions, DraftModel, Drafting, OptionError, option
from aggdec.decoding.state import DecodeState
from aggdec.model.draft_head import DraftHead
from aggdec.model.linear import linear, prepack
from aggdec.model.projection import draft_argmax
from aggdec.model.transformer import Transformer


@dataclass(frozen=True, kw_only=True)
class GADOptions(Drafting, DraftModel, DecodeOptions):
    """GAD (SpecDec): a draft head proposes `block_size` tokens, exact top-1 verification (lossless
    unless min_block > 0)."""

    method: ClassVar[str] = "gad"

    def acceptance(self) -> Acceptance:
        return MinBlock.around(ExactMatch(), self.min_block)


@dataclass(frozen=True, kw_only=True)
class GADPlusOptions(GADOptions):
    """GAD++: a drafted token is accepted within the verifier's top-beta and log-prob gap tau (lossy)."""

    method: ClassVar[str] = "gad++"

    top_beta: int = option(3, "Accept a drafted token within the verifier's top-beta ...", low=1)
    tau: float = option(1.0, "... and within tau of the top log-probability.", low=0)

    def acceptance(self) -> Acceptance:
        return MinBlock.around(TopKTolerance(self.top_beta, self.tau), self.min_block)


_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""head -> {(id of verifier, id of output weight): (verifier, output weight, draft weight, its oneDNN
packing, draft bias, token table)}; the entry holds the verifier and output weight, so their ids stay
theirs."""


def _prepared(verifier: Transformer, head: DraftHead, out_weight: torch.Tensor | None):
    """The head's draft-vocabulary output weight (prepacked), the verifier's output bias on it (None
    without one) and the fused token table on `verifier`, built once per head, verifier and output
    weight, not once per run."""
    key = (id(verifier), None if out_weight is None else id(out_weight))
    cache = _PREPARED.setdefault(head, {})
    if key not in cache:
        dtype = next(head.parameters()).dtype
        weight, bias = verifier.output_weight if out_weight is None else out_weight, verifier.output_bias
        if head.cfg.draft_vocab:
            weight = weight[head.vocab]
            bias = None if bias is None else bias[head.vocab]
        weight = weight.detach().to(dtype).contiguous()
        bias = None if bias is None else bias.detach().to(dtype)
        dec = verifier.decoder
        with torch.no_grad():
            table = head.token_context((dec.embed_scale * dec.embed_tokens.weight).to(dtype)).contiguous()
        cache[key] = (verifier, out_weight, weight, prepack(weight), bias, table)
    return cache[key][2:]


class DraftHeadDrafter:
    """Drafter for the shared loop; `block_size` (at most the head's) tokens per call.

    out_weight (V, D): the output projection to draft with (default: the verifier's, in the head's
    dtype); only the head's draft vocabulary rows are used.
    """

    name = "gad"

    def __init__(self, verifier: Transformer, head: DraftHead, block_size: int | None = None,
                 out_weight: torch.Tensor | None = None):
        self.head = head
        self.k = head.cfg.block_size if block_size is None else min(block_size, head.cfg.block_size)
        self.weight, self.packed, self.bias, self.token_table = _prepared(verifier, head, out_weight)
        dec = verifier.decoder
        self.last_layer = len(dec.layers) - 1
        self.vocab = head.vocab if head.cfg.draft_vocab else None
        self.max_draft = self.k
        self.rows = RowState()  # pending (B, k): the next draft; ready (B,): the row has one

    @classmethod
    def from_options(cls, opts, ctx) -> "DraftHeadDrafter":
        """The head of `opts.drafter` on the verifier of `ctx` (a methods.DraftContext)."""
        head = ctx.drafter_model(opts.drafter)
        if not isinstance(head, DraftHead):
            raise OptionError("drafter", f"{opts.drafter}: not a draft head (gad and gad++ draft with a head "
                                         "trained by `python -m aggdec.train.draft_head`)")
        return cls(ctx.model, head, opts.block_size,
                   out_weight=ctx.projection.draft_weight_bf16 if ctx.bf16 else None)

    def admit(self, state: DecodeState, slots: torch.Tensor) -> None:
        if self.rows.admit(state, slots, ready=False):  # a new batch; refilled rows keep stale drafts, not ready
            self.rows.pending = torch.full((state.batch_size, self.k), state.pad, device=state.out.device)

    def select(self, rows: torch.Tensor) -> None:
        self.rows.select(rows)

    def propose(self, state: DecodeState) -> DraftBatch:
        ready = self.rows.ready
        if not bool(ready.any()):
            return DraftBatch.empty(state.batch_size, state.out.device, state.pad)
        pending = self.rows.pending
        return DraftBatch(tokens=pending.clone(), num_draft=torch.where(ready, pending.shape[1], 0))

    @torch.no_grad()
    def observe(self, state, draft, accepted, hidden):
        k = state.next_draft(self.k)
        if k == 0:  # the next call drafts nothing
            self.rows.ready = torch.zeros_like(self.rows.ready)
            return
        dtype = self.weight.dtype
        ctx = self.head.context(hidden.to(dtype), self.token_table, state.last_tokens())
        cache, layer = state.cache, self.last_layer
        span = int(cache.lengths.max())
        pk, pv = cache.k[layer][:, :span].to(dtype), cache.v[layer][:, :span].to(dtype)
        keep = torch.arange(span, device=pk.device)[None] < cache.lengths[:, None]
        ck, cv = cache.cross.k[layer].to(dtype), cache.cross.v[layer].to(dtype)
        states = self.head.from_context(ctx, pk, pv, keep, ck, cv, cache.cross.src_pad, k)
        logits = linear(states, self.weight, self.bias, packed=self.packed)  # (B, k, V_draft)
        if self.vocab is None:
            logits[..., state.pad] = -float("inf")
        ids = draft_argmax(logits)
        self.rows.pending = ids if self.vocab is None else self.vocab[ids]
        self.rows.ready = torch.ones_like(self.rows.ready)
