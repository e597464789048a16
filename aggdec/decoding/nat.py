"""GAD's drafter: a non-autoregressive block drafter with its own encoder and a cached prefix.

The drafter is a `Transformer` whose target vocabulary has one extra symbol, `mask_id` (= the
verifier's vocabulary size). Given the accepted prefix (eos, o_1 .. o_j) and k mask tokens, it
predicts o_{j+1} .. o_{j+k} in one pass. Unlike the paper's drafter, whose prefix attends
bidirectionally (so it must be recomputed every iteration), ours keeps the prefix causal and lets
only the mask tokens attend to each other: prefix K/V are cached and committed like the
verifier's, and each iteration feeds only the newly accepted tokens plus the masks.

Layout of one drafter call, row b (n_b new prefix tokens, k_b masks, right-padded to the batch):
    [new_1 .. new_{n_b}, M_1 .. M_{k_b}, pad ...]  at cache positions lengths[b] + t
The pads are packed away (`Transformer.decode_hidden(valid=...)`): the drafter's linear layers run
on the rows' real tokens only.
Prefix token t attends to keys <= its position; mask tokens attend to keys <= the last mask.
Only the n_b prefix positions are committed; the masks are rolled back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from aggdec.decoding.acceptance import Acceptance, ExactMatch, MinBlock, TopKTolerance
from aggdec.decoding.drafters import RowState, adapt_length
from aggdec.decoding.metadata import DraftBatch
from aggdec.decoding.options import AdaptiveDraft, DecodeOptions, DraftModel, Drafting, option
from aggdec.decoding.state import DecodeState
from aggdec.model.cache import DecoderCache
from aggdec.model.projection import draft_argmax
from aggdec.model.transformer import Transformer


@dataclass(frozen=True, kw_only=True)
class GADOptions(Drafting, DraftModel, AdaptiveDraft, DecodeOptions):
    """GAD (SpecDec): a NAR drafter proposes `block_size` tokens, exact top-1 verification (lossless
    unless min_block > 0). With adaptive_draft a row's block size moves between 2 and block_size."""

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


def block_layout(n_new: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks of a drafter call. n_new, k, lengths: (B,) int64.

    Returns (is_prefix (B,T), is_mask (B,T), key_limit (B,T)) with T = max(n_new + k).
    """
    width = int((n_new + k).max())
    t = torch.arange(width, device=n_new.device)[None]
    is_prefix = t < n_new[:, None]
    is_mask = (t >= n_new[:, None]) & (t < (n_new + k)[:, None])
    pos = lengths[:, None] + t
    last_mask = (lengths + n_new + k - 1)[:, None]
    key_limit = torch.where(is_mask, last_mask.expand_as(pos), pos)
    return is_prefix, is_mask, key_limit


class NATDrafter:
    """GAD/SpecDec drafter for the shared loop. `block_size` masks per row per call.

    adaptive: per-row block size (`adapt_length`) between `min_draft` and `block_size`.
    """

    name = "gad"

    def __init__(self, model: Transformer, mask_id: int, block_size: int = 10, adaptive: bool = False, min_draft: int = 2):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if mask_id != model.cfg.tgt_vocab - 1:
            raise ValueError(f"mask_id {mask_id} must be the drafter's last target symbol ({model.cfg.tgt_vocab - 1})")
        self.model = model
        self.mask_id = mask_id
        self.block_size = block_size
        self.adaptive = adaptive
        self.min_draft = min(min_draft, block_size)
        self.max_draft = block_size
        self.cache: DecoderCache | None = None
        self.rows = RowState()  # k: (B,) per-row block size

    @classmethod
    def from_options(cls, opts: GADOptions, ctx) -> "NATDrafter":
        """The drafter of `opts.drafter` for the verifier of `ctx` (a methods.DraftContext)."""
        nat = ctx.drafter_model(opts.drafter)
        return cls(nat.model, nat.meta["mask_id"], opts.block_size, adaptive=opts.adaptive_draft)

    def admit(self, state: DecodeState, slots: torch.Tensor) -> None:
        if self.rows.admit(state, slots, k=self.block_size) or self.cache is None:
            self.cache = self.model.start(state.src, capacity=32)
            return
        memory, src_pad = self.model.encode(state.src[slots, : int(state.src_len[slots].max())])
        self.cache.replace(slots, self.model.cross_kv(memory, src_pad))

    def select(self, rows: torch.Tensor) -> None:
        self.cache.select(rows)
        self.rows.select(rows)

    @torch.no_grad()
    def propose(self, state: DecodeState) -> DraftBatch:
        cache = self.cache
        lengths = cache.lengths
        n_new = state.out_len - lengths  # tokens the drafter has not seen yet (>= 1)
        k = torch.minimum(self.rows.k, state.budget)
        if not bool((k > 0).any()):  # the prefix is fed with the next drafting call
            return DraftBatch.empty(state.batch_size, lengths.device, state.pad)
        is_prefix, is_mask, key_limit = block_layout(n_new, k, lengths)
        width = is_prefix.shape[1]
        src_idx = (lengths[:, None] + torch.arange(width, device=lengths.device)).clamp(max=state.out.shape[1] - 1)
        tokens = state.out.gather(1, src_idx)
        tokens = torch.where(is_mask, torch.full_like(tokens, self.mask_id), tokens)
        valid = is_prefix | is_mask  # a prefix of each row
        tokens = torch.where(valid, tokens, torch.full_like(tokens, state.pad))
        hidden = self.model.decode_hidden(tokens, cache, key_limit=key_limit, valid=valid)  # (N, D), packed
        cache.commit(n_new)
        logits = self.model.output_logits(hidden[is_mask[valid]])  # (sum k, V+1)
        logits[:, self.mask_id] = -float("inf")
        logits[:, state.pad] = -float("inf")
        kmax = int(k.max())
        draft = torch.full((state.batch_size, kmax), state.pad, dtype=torch.long, device=lengths.device)
        slot = torch.arange(kmax, device=lengths.device)[None] < k[:, None]
        draft[slot] = draft_argmax(logits)
        return DraftBatch(tokens=draft, num_draft=k.clone())

    def observe(self, state, draft, accepted, hidden):
        if self.adaptive:
            self.rows.k = adapt_length(self.rows.k, draft.num_draft, accepted, self.min_draft, self.block_size)
