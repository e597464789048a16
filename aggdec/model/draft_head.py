"""GAD's draft head: a small non-autoregressive block drafter that reads the verifier (docs/design.md,
"GAD draft head"). Row b's verifier state h (the one that produced its bonus token t) and t are fused
into x_0 = W [h ; e(t)]; `block_size` mask queries x_i = m_i attend to it, to each other and to the
verifier's last-layer self-attention K/V of the prefix, and cross-attend to its last-layer cross K/V
(pre-norm layers); draft_i = argmax W_out[vocab] . LN(x_i) with the verifier's output projection.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aggdec.model.linear import Linear


@dataclass(frozen=True)
class DraftHeadConfig:
    d_model: int
    heads: int  # the verifier's decoder heads (cross-attention reads its keys/values)
    kv_dim: int = 0  # width of the verifier's keys/values (a T5's heads * d_kv); 0: d_model
    ffn: int = 1024
    layers: int = 1  # attention layers (at least one)
    block_size: int = 4  # mask queries: most tokens drafted per call
    draft_vocab: int = 0  # rows of the draft vocabulary (0: the verifier's whole vocabulary)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv: bool, inner: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.out_proj = Linear(dim, inner), Linear(inner, dim)
        if kv:
            self.k_proj, self.v_proj = Linear(dim, inner), Linear(dim, inner)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """q (B,T,D) queries before q_proj; k, v (B,L,E) projected (E: kv_dim); keep (B,1,1|T,L) bool or None."""
        b, t, _ = q.shape
        qh, kh, vh = (x.unflatten(-1, (self.heads, -1)).transpose(1, 2) for x in (self.q_proj(q), k, v))
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class _Layer(nn.Module):
    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = _Attention(d, cfg.heads, kv=True, inner=cfg.kv_dim or d)
        self.cross_attn = _Attention(d, cfg.heads, kv=False, inner=cfg.kv_dim or d)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.fc2 = Linear(d, cfg.ffn), Linear(cfg.ffn, d)

    def forward(self, x: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, self_keep: torch.Tensor,
                cross_k: torch.Tensor, cross_v: torch.Tensor, cross_keep: torch.Tensor) -> torch.Tensor:
        """x (N,K1,D): a block of K1 = k + 1 positions per row, self-attending to the row's prefix keys/values
        (prefix_k/v (N,L,E), E: kv_dim) and the block, keep (N,1,1,L+K1); cross_k/v (N,S,E), keep (N,1,1,S)."""
        h = self.norm1(x)
        k = torch.cat([prefix_k, self.self_attn.k_proj(h)], dim=1)
        v = torch.cat([prefix_v, self.self_attn.v_proj(h)], dim=1)
        x = x + self.self_attn(h, k, v, self_keep)
        x = x + self.cross_attn(self.norm2(x), cross_k, cross_v, cross_keep)
        return x + self.fc2(self.fc1.relu(self.norm3(x)))


class DraftHead(nn.Module):
    """See the module docstring. `vocab` (draft_vocab,) int64 buffer: the token ids the head can draft
    (all of the verifier's when draft_vocab is 0)."""

    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        if cfg.layers < 1:
            raise ValueError(f"layers: a draft head needs at least one attention layer, got {cfg.layers}")
        self.cfg = cfg
        d = cfg.d_model
        self.fuse = Linear(2 * d, d)
        self.masks = nn.Parameter(torch.randn(cfg.block_size, d) * d**-0.5)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(d)
        self.register_buffer("vocab", torch.arange(cfg.draft_vocab, dtype=torch.long))

    def context(self, h: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """The fused context (N,D) of states h (N,D) and the embeddings (N,D) of the tokens they produced:
        `fuse` on the two halves of its input apart, h @ W_h.T + (token_emb @ W_t.T + bias)."""
        d = self.cfg.d_model
        return F.linear(h, self.fuse.weight[:, :d]) + F.linear(token_emb, self.fuse.weight[:, d:], self.fuse.bias)

    def states(self, h: torch.Tensor, token_emb: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
               prefix_keep: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor, src_pad: torch.Tensor,
               k: int | None = None) -> torch.Tensor:
        """Final states (N,k,D) of the first `k` masks (default all). h, token_emb (N,D): verifier states
        and the embeddings of the tokens they produced; prefix_k/v (N,L,E), prefix_keep (N,L) bool: the
        verifier's last-layer self-attention K/V of each row's prefix; cross_k/v (N,S,E), src_pad (N,S)
        bool: its last-layer cross-attention K/V of each row's source."""
        return self.from_context(self.fuse(torch.cat([h, token_emb], dim=-1)), prefix_k, prefix_v, prefix_keep,
                                 cross_k, cross_v, src_pad, k)

    def from_context(self, ctx: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                     prefix_keep: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor,
                     src_pad: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """As `states`, from the fused context (N,D)."""
        k = self.cfg.block_size if k is None else k
        n, d = ctx.shape
        x = torch.cat([ctx[:, None], self.masks[:k].to(ctx.dtype).expand(n, k, d)], dim=1)  # (N,k+1,D)
        self_keep = torch.cat([prefix_keep, prefix_keep.new_ones(n, k + 1)], dim=1)[:, None, None, :]
        cross_keep = (~src_pad)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, prefix_k, prefix_v, self_keep, cross_k, cross_v, cross_keep)
        return self.norm(x[:, 1:])
