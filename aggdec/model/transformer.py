"""Encoder-decoder Transformer covering fairseq's `transformer` family, with cached block decoding.

Parameter names equal fairseq's state-dict keys (encoder.layers.0.self_attn.q_proj.weight, ...), so
a fairseq checkpoint loads with a plain `load_state_dict`. Shapes: B batch, S source length,
T new target tokens in this call, L visible target prefix, D model dim, H heads, V vocabulary.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from aggdec.double_token import pair_limit
from aggdec.model import decode_attention, invariant
from aggdec.model.cache import CrossKV, DecoderCache
from aggdec.model.config import ModelConfig
from aggdec.model.linear import FusedLinear, Linear, PackedWeight, linear, packed_for
from aggdec.model.relative_bias import RelativeBias
from aggdec.model.slots import SlotCache, Tokens


def sinusoidal_table(num: int, dim: int, padding_idx: int | None, layout: str = "fairseq") -> torch.Tensor:
    """A sinusoidal position table (num, dim) with [sin | cos] halves. layout "fairseq" (also M2M100/NLLB):
    frequencies 10000^(-i / (dim/2 - 1)), in float32, row `padding_idx` zeroed. "marian" (Marian/OPUS-MT):
    frequencies 10000^(-2i / dim), in float64, no zeroed row."""
    half = dim // 2
    if layout == "marian":
        pos = torch.arange(num, dtype=torch.float64)[:, None]
        j = torch.arange(dim, dtype=torch.float64)[None]
        angles = pos / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / dim)
        return torch.cat([torch.sin(angles[:, 0::2]), torch.cos(angles[:, 1::2])], dim=1).float()
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float) * -step)
    angles = torch.arange(num, dtype=torch.float)[:, None] * freqs[None]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num, 1)], dim=1)
    if padding_idx is not None and padding_idx < num:
        table[padding_idx] = 0
    return table


class Positions(nn.Module):
    """Learned or sinusoidal positions; row cfg.position_offset + i embeds position i."""

    def __init__(self, cfg: ModelConfig, max_positions: int, learned: bool):
        super().__init__()
        dim, pad = cfg.d_model, cfg.pad
        self.learned = learned
        self.rows = max_positions + cfg.position_offset
        zeroed = pad if cfg.first_position is None else None  # fairseq's table has a zero row at pad
        if learned:
            self.weight = nn.Parameter(torch.empty(self.rows, dim))
            nn.init.normal_(self.weight, mean=0, std=dim**-0.5)
            if zeroed is not None:
                nn.init.zeros_(self.weight[zeroed])
        else:
            self.register_buffer("table", sinusoidal_table(self.rows, dim, zeroed, cfg.sinusoidal), persistent=False)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        """index: int64 table rows (any shape), already offset by cfg.position_offset -> (..., D)."""
        return F.embedding(index, self.weight) if self.learned else self.table[index]


class RMSNorm(nn.Module):
    """T5's layer norm: x / sqrt(mean(x^2) + eps) * weight (no mean subtracted, no bias); the variance and
    a half-precision model's normalized states (cast back before the weight) in fp32 at least."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if invariant.active():
            return invariant.norm(x, self.weight, None, self.eps, rms=True)
        if x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        variance = x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(self.weight.dtype)


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (same parameters and state-dict keys); within `invariant.kernels()` at inference, the
    batch-invariant kernel's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if invariant.active():
            return invariant.norm(x, self.weight, self.bias, self.eps)
        return super().forward(x)


def layer_norm(cfg: ModelConfig) -> nn.Module:
    """A norm over d_model of the kind the config names (`cfg.norm`)."""
    return RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.norm == "rms" else LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class MultiheadAttention(nn.Module):
    """Projections (D -> H*Dh for queries, keys, values; back to D) and dot-product attention, scores
    scaled by Dh ** -0.5 unless `scaled` is False (T5), with an optional additive bias (`core`)."""

    def __init__(self, dim: int, heads: int, dropout: float, head_dim: int | None = None, bias: bool = True,
                 scaled: bool = True):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        inner = dim if head_dim is None else heads * head_dim
        self.scale = (inner // heads) ** -0.5 if scaled else 1.0
        self.q_proj = Linear(dim, inner, bias=bias)
        self.k_proj = Linear(dim, inner, bias=bias)
        self.v_proj = Linear(dim, inner, bias=bias)
        self.out_proj = Linear(inner, dim, bias=bias)
        self._qkv, self._kv = FusedLinear(), FusedLinear()

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_proj(x), k_proj(x), v_proj(x)), one product at inference (`FusedLinear`)."""
        return self._qkv((self.q_proj, self.k_proj, self.v_proj), x)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_proj(x), v_proj(x)), one product at inference (`FusedLinear`)."""
        return self._kv((self.k_proj, self.v_proj), x)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """q (B,T,D) projected queries; k, v (B,L,D) projected keys/values; keep (B,1,T|1,L) bool
        -> (B,T,D) attention output before out_proj. bias (B|1,H,T,L), optional: added to the scaled
        scores (T5's relative positions)."""
        b, t, d = q.shape
        h = self.heads
        # unflatten splits only the last dimension: a cache prefix's view needs no contiguity check
        q, k, v = (x.unflatten(-1, (h, d // h)).transpose(1, 2) for x in (q, k, v))  # (B,H,T|L,Dh)
        p = self.dropout if self.training else 0.0
        mask = keep if bias is None else bias.masked_fill(~keep, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=self.scale)  # (B,H,T,Dh)
        return out.transpose(1, 2).reshape(b, t, d)

    def core_shared(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                    group: int) -> torch.Tensor:
        """`core` where each `group` consecutive query rows share one row of keys/values (beam search's
        cross-attention: a sentence's beams, one product against its source), in fairseq's arithmetic
        (scaled queries, products, softmax): q (B,T,D), B = G * group; k, v (G,H,L,Dh); keep (G,1,1,L)."""
        b, t, d = q.shape
        h, g = self.heads, b // group
        q = (q * self.scale).reshape(g, group * t, h, d // h).transpose(1, 2)  # (G,H,group*T,Dh)
        weights = torch.matmul(q, k.transpose(-1, -2)).masked_fill_(~keep, float("-inf")).softmax(dim=-1)
        return torch.matmul(weights, v).transpose(1, 2).reshape(b, t, d)

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (B,T,D) queries -> (B,T,D): q_proj, attention over projected k/v (`core`), out_proj."""
        return self.out_proj(self.core(self.q_proj(x), k, v, keep, bias=bias))


ACTIVATION = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh"), "silu": F.silu}


def dropout_in_training(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`F.dropout`, but `x` itself where it changes nothing (inference, or p = 0): no operator dispatched."""
    return F.dropout(x, p, training) if training and p > 0 else x


class Layer(nn.Module):
    """An encoder layer, or with `cross` a decoder layer (cross-attention after self-attention), with
    fairseq's names; fc3 is the linear half of a gated FFN (T5 v1.1's wi_1)."""

    def __init__(self, cfg: ModelConfig, cross: bool):
        super().__init__()
        side, d = "dec" if cross else "enc", cfg.d_model
        heads, ffn = getattr(cfg, f"{side}_heads"), getattr(cfg, f"{side}_ffn")
        self.pre = getattr(cfg, f"{side}_normalize_before")
        self.dropout, self.activation_dropout = cfg.dropout, cfg.activation_dropout
        attention = partial(MultiheadAttention, d, heads, cfg.attention_dropout, cfg.head_dim, cfg.linear_bias,
                            cfg.attention_scale)
        self.self_attn, self.self_attn_layer_norm = attention(), layer_norm(cfg)
        if cross:
            self.encoder_attn, self.encoder_attn_layer_norm = attention(), layer_norm(cfg)
        self.act = ACTIVATION[cfg.activation]
        self.fc1 = Linear(d, ffn, bias=cfg.linear_bias)
        self.fc3 = Linear(d, ffn, bias=cfg.linear_bias) if cfg.gated_ffn else None
        self.fc2 = Linear(ffn, d, bias=cfg.linear_bias)
        self._up = FusedLinear()
        self.final_layer_norm = layer_norm(cfg)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc3 is not None:  # gated: act(fc1(x)) * fc3(x), one product at inference
            a, b = self._up((self.fc1, self.fc3), x)
            h = self.act(a) * b
        else:
            h = self.fc1.relu(x) if self.act is F.relu else self.act(self.fc1(x))
        return self.fc2(dropout_in_training(h, self.activation_dropout, self.training))

    def _residual(self, x: torch.Tensor, norm: nn.Module, sublayer) -> torch.Tensor:
        """x + dropout(sublayer(x)), normalized before (pre-norm) or after (post-norm)."""
        h = sublayer(norm(x) if self.pre else x)
        x = x + dropout_in_training(h, self.dropout, self.training)
        return x if self.pre else norm(x)

    def forward(self, x: torch.Tensor, self_attn, cross_attn=None) -> torch.Tensor:
        """x: token states, (B,T,D) or packed (N,D). self_attn(h) / cross_attn(h) (a decoder layer's)
        return attention outputs in the layout of h (they own projections, masks, cache and layout)."""
        x = self._residual(x, self.self_attn_layer_norm, self_attn)
        if cross_attn is not None:
            x = self._residual(x, self.encoder_attn_layer_norm, cross_attn)
        return self._residual(x, self.final_layer_norm, self.ffn)


class Stack(nn.Module):
    """Embeddings + layers of one side, named as fairseq's `encoder.*` / `decoder.*`. Positions are
    absolute (`embed_positions`) or, with `cfg.relative_buckets`, T5's relative bias
    (`relative_attention_bias`: one table, or one per layer with `cfg.relative_per_layer`)."""

    def __init__(self, cfg: ModelConfig, decoder: bool):
        super().__init__()
        d, side = cfg.d_model, "dec" if decoder else "enc"
        n, heads = getattr(cfg, f"{side}_layers"), getattr(cfg, f"{side}_heads")
        vocab = cfg.tgt_vocab if decoder else cfg.src_vocab
        max_pos = cfg.max_target_positions if decoder else cfg.max_source_positions
        self.dropout = cfg.dropout
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(d)
        self.embed_tokens = nn.Embedding(vocab, d, padding_idx=cfg.pad)
        nn.init.normal_(self.embed_tokens.weight, mean=0, std=d**-0.5)
        nn.init.zeros_(self.embed_tokens.weight[cfg.pad])
        self.position_offset = cfg.position_offset
        learned = getattr(cfg, f"{side}_learned_pos")
        self.embed_positions = None if cfg.relative_buckets else Positions(cfg, max_pos, learned)
        self.relative_attention_bias = nn.ModuleList(
            RelativeBias(cfg.relative_buckets, heads, cfg.relative_max_distance, not decoder)
            for _ in range(n if cfg.relative_per_layer else 1)) if cfg.relative_buckets else None
        self.layernorm_embedding = LayerNorm(d) if cfg.layernorm_embedding else None
        self.layers = nn.ModuleList(Layer(cfg, decoder) for _ in range(n))
        self.layer_norm = layer_norm(cfg) if getattr(cfg, f"{side}_normalize_before") else None

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens and their positions (0-based, int64, same shape) -> (..., D). Positions past the
        table (the padding of short blocks, whose outputs are never used) read its last row."""
        x = self.embed_tokens(tokens)
        x = self.embed_scale * x if self.embed_scale != 1.0 else x
        if self.embed_positions is not None:
            x = x + self.embed_positions((positions + self.position_offset).clamp(max=self.embed_positions.rows - 1))
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        return dropout_in_training(x, self.dropout, self.training)

    def position_bias(self, query: torch.Tensor, keys: int) -> list[torch.Tensor | None]:
        """Each layer's self-attention score bias (B,H,T,keys) for queries at positions `query` (B,T) over
        key positions 0 .. keys - 1: T5's relative positions (once per table), or None for each layer."""
        tables = self.relative_attention_bias
        if tables is None:
            return [None] * len(self.layers)
        index = tables[0].index(query, keys)
        biases = [table(index) for table in tables]
        return biases if len(biases) > 1 else biases * len(self.layers)


def kernel_attend(mha: MultiheadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sees: torch.Tensor,
                  rows: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`decode_attention.attend` with `mha`'s heads and scale: q (B,T,D) over k, v (B',L,D), query [b, t]
    seeing sees[b, t] keys (of row rows[b, j], optional); a half-precision model's queries over an fp32
    cache in fp32, returned in their dtype."""
    if q.dtype == k.dtype:
        return decode_attention.attend(q, k, v, sees, mha.heads, rows, bias, mha.scale)
    bias = None if bias is None else bias.to(k.dtype)
    return decode_attention.attend(q.to(k.dtype), k, v, sees, mha.heads, rows, bias, mha.scale).to(q.dtype)


def slot_attention(tokens: Tokens, cache: SlotCache, span: int, width: int, pairs: bool) -> tuple:
    """How `Transformer.decode_slots` attends, by device: (self_attend(mha, q, k, v, bias),
    cross_attend(mha, q, k, v), query). Queries q (N,1,D) -> (N,1,D), a query a token; k, v: a slot
    cache's keys and values (slots, span, D), or (slots, width, D) for the source; `query`: the tokens'
    positions as `Stack.position_bias` takes them, for `bias`. Where the CPU kernel runs for the cache's
    dtype (`decode_attention.usable`), each token reads its own slot's keys up to its position (`pairs`:
    the end of its pair) and its source, through a row map; query (N,1), bias (N,H,1,span). Elsewhere
    masked products on the slot grid, which `tokens` must fill (`Tokens.full`); query (B,T), bias
    (B,H,T,span)."""
    n, (b, t) = tokens.ids.shape[0], tokens.shape
    if decode_attention.usable(tokens.ids.device, cache.k[0].dtype):
        query, slots = tokens.pos[:, None], tokens.rows[:, None]
        sees = ((pair_limit(query) if pairs else query) + 1).clamp(max=span)  # (N,1)
        source = cache.src_count[slots].clamp(max=width)

        return (partial(kernel_attend, sees=sees, rows=slots.expand(n, span)),
                partial(kernel_attend, sees=source, rows=slots.expand(n, width)), query)
    if n != b * t:
        raise ValueError("masked slot attention takes every position of every slot (Tokens.full)")
    query = tokens.pos.view(b, t)
    limit = pair_limit(query) if pairs else query
    causal = (torch.arange(span, device=query.device)[None, None, :] <= limit[:, :, None])[:, None]  # (B,1,T,span)

    def masked(keep, mha, q, k, v, bias=None):
        return mha.core(q.view(b, t, -1), k, v, keep, bias).view(n, 1, -1)

    return partial(masked, causal), partial(masked, cache.src_keep[:, None, None, :width]), query


class Transformer(nn.Module):
    """fairseq-compatible encoder-decoder (shape letters: module docstring). `output_int8`: None, or the
    output projection quantized (aggdec.model.precision), which then computes the logits."""

    output_int8 = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder, self.decoder = Stack(cfg, decoder=False), Stack(cfg, decoder=True)
        if cfg.share_all_embeddings:
            self.decoder.embed_tokens.weight = self.encoder.embed_tokens.weight
        if (cfg.share_decoder_input_output_embed or cfg.share_all_embeddings) and not cfg.untied_output:
            self.decoder.output_projection = None
        else:
            self.decoder.output_projection = Linear(cfg.d_model, cfg.tgt_vocab, bias=False)
            nn.init.normal_(self.decoder.output_projection.weight, mean=0, std=cfg.d_model**-0.5)
        self.decoder.output_bias = nn.Parameter(torch.zeros(cfg.tgt_vocab)) if cfg.output_bias else None
        self._output_pack = PackedWeight()  # output_logits' prepacked weight

    # -- encoder ---------------------------------------------------------------------------------

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src (B,S) int64, right-padded with pad -> (memory (B,S,D), zero at padding; src_pad (B,S)).
        Padded batches run packed: all but attention on the N real tokens only (docs/design.md,
        "Packed tokens"); with the CPU kernel, each token's query reads its sentence's keys only."""
        src_pad = src.eq(self.cfg.pad)
        valid = ~src_pad
        nonpad = valid.long()
        pos = (torch.cumsum(nonpad, dim=1) - 1) * nonpad
        keep = valid[:, None, None, :]  # (B,1,1,S)
        packed = not bool(valid.all())
        x = self.encoder.embed(src[valid], pos[valid]) if packed else self.encoder.embed(src, pos)
        (bsz, width), kernel = src.shape, decode_attention.usable(src.device, x.dtype)
        # the queries' positions as `position_bias` takes them: each packed token's for the kernel, else the grid's
        query = pos[valid][:, None] if kernel and packed else torch.arange(width, device=src.device)[None]
        biases = self.encoder.position_bias(query, width)  # (N,H,1,S) or (1,H,S,S) each, or None

        def unpack(y: torch.Tensor) -> torch.Tensor:
            return y.new_zeros(*src.shape, y.shape[-1]).index_put_((valid,), y) if packed else y

        sees = rows = None  # with the CPU kernel: each query's number of keys, and its row's (packed)
        if kernel:
            lengths = nonpad.sum(dim=1)
            if packed:  # a query per real token, its sentence's keys read through a row map
                sentence = torch.arange(bsz, device=src.device)[:, None].expand_as(src)[valid]
                sees, rows = lengths[sentence][:, None], sentence[:, None].expand(-1, width)
            else:
                sees = lengths[:, None].expand_as(src)
                biases = [None if b is None else b.expand(bsz, -1, -1, -1) for b in biases]

        def self_attn(h: torch.Tensor, sa: MultiheadAttention, bias: torch.Tensor | None) -> torch.Tensor:
            q, k, v = sa.qkv(h)
            if sees is None:
                out = sa.core(unpack(q), unpack(k), unpack(v), keep, bias=bias)
                return sa.out_proj(out[valid] if packed else out)
            if packed:  # (N,1,D): one query per token
                return sa.out_proj(decode_attention.attend(q[:, None], unpack(k), unpack(v), sees, sa.heads, rows,
                                                           bias, sa.scale)[:, 0])
            return sa.out_proj(decode_attention.attend(q, k, v, sees, sa.heads, bias=bias, scale=sa.scale))

        for layer, bias in zip(self.encoder.layers, biases):
            x = layer(x, lambda h, sa=layer.self_attn, bias=bias: self_attn(h, sa, bias))
        if self.encoder.layer_norm is not None:
            x = self.encoder.layer_norm(x)
        return unpack(x), src_pad

    def cross_kv(self, memory: torch.Tensor, src_pad: torch.Tensor) -> CrossKV:
        """Project encoder output to each decoder layer's cross-attention K/V, once per sentence."""
        kvs = [layer.encoder_attn.kv(memory) for layer in self.decoder.layers]
        return CrossKV(k=[k.contiguous() for k, _ in kvs], v=[v.contiguous() for _, v in kvs], src_pad=src_pad)

    def start(self, src: torch.Tensor, capacity: int = 64, group: int = 1, indirect: bool = False) -> DecoderCache:
        """Encode `src` and return an empty decoder cache for it (`group`, `indirect`: `DecoderCache`)."""
        return self.start_from(*self.encode(src), capacity=capacity, group=group, indirect=indirect)

    def start_from(self, memory: torch.Tensor, src_pad: torch.Tensor, capacity: int = 64,
                   group: int = 1, indirect: bool = False) -> DecoderCache:
        """An empty decoder cache for encoder output `memory` (B,S,D) with padding mask `src_pad`."""
        return DecoderCache(self.cross_kv(memory, src_pad), self.cfg.dec_layers, self.cfg.inner_dim(self.cfg.dec_heads),
                            capacity, group, indirect)

    # -- decoder ---------------------------------------------------------------------------------

    @property
    def output_weight(self) -> torch.Tensor:
        """(V, D): logits = hidden @ output_weight.T + output_bias."""
        tied = self.decoder.output_projection is None
        return (self.decoder.embed_tokens if tied else self.decoder.output_projection).weight

    @property
    def output_bias(self) -> torch.Tensor | None:
        """(V,) or None: the bias of the output logits (cfg.output_bias)."""
        return self.decoder.output_bias

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> logits (..., V); from 2 rows on, an fp32 CPU product takes the weight prepacked
        once (equal there; one row's unpacked product differs)."""
        if self.output_int8 is not None:
            return self.output_int8(x)
        w = self.output_weight
        return linear(x, w, self.output_bias, packed=packed_for(self._output_pack, w, x, min_rows=2))

    def decode(self, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """Score a block of T new tokens per row on top of each row's cached prefix: tokens (B,T) int64,
        row b's at positions cache.lengths[b] + t -> logits (B,T,V), [b, t] predicting the token after
        tokens[b, t]. All T positions are written to the cache, none committed (`cache.commit(n)`)."""
        return self.output_logits(self.decode_hidden(tokens, cache))

    def decode_hidden(self, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """As `decode`, but -> the final decoder states (B,T,D). Causal: each position attends to itself
        and before (a double-token model: to the end of its pair; its blocks hold whole pairs)."""
        bsz, t = tokens.shape
        cache.reserve(t)
        pos = cache.lengths[:, None] + torch.arange(t, device=tokens.device)  # (B,T) absolute positions
        span = cache.length + t
        cross_keep = cache.cross.keep  # (B',1,1,S), B' = B / cache.group
        ragged = decode_attention.usable(tokens.device, cache.k[0].dtype)
        self_rows, cross_rows, cross_count = cache.key_rows(span), None, cache.cross.count
        if self_rows is not None and not ragged:
            raise ValueError("a cache with indirect reorders is read by the CPU attention kernel only "
                             "(decode_attention.usable: gradients off)")
        sources = cache.cross_rows() if ragged else None
        if sources is not None:  # each sentence's source, read by its beams through a row map
            cross_rows, cross_count = sources[:, None].expand(bsz, cross_keep.shape[-1]), cross_count[sources]
        attend, self_sees, cross_sees = self._attention(self._default_limit(pos), span, cross_count, cross_keep,
                                                        ragged)
        biases = self.decoder.position_bias(pos, span)  # (B,H,T,span) each, or None
        x = self.decoder.embed(tokens, pos)
        for i, (layer, bias) in enumerate(zip(self.decoder.layers, biases)):
            sa, ca = layer.self_attn, layer.encoder_attn

            def self_attn(h, i=i, sa=sa, bias=bias):
                q, k, v = sa.qkv(h)
                k, v = cache.write(i, k, v, span)
                return sa.out_proj(attend(sa, q, k, v, self_sees, self_rows, bias))

            def cross_attn(h, i=i, ca=ca):
                if cache.group > 1 and not ragged:  # beams sharing their sentence's cross K/V
                    return ca.out_proj(ca.core_shared(ca.q_proj(h), *cache.cross_heads(i, ca.heads), cross_keep,
                                                      cache.group))
                return ca.out_proj(attend(ca, ca.q_proj(h), cache.cross.k[i], cache.cross.v[i], cross_sees, cross_rows))

            x = layer(x, self_attn, cross_attn)
        return self._final(x)

    def decode_slots(self, tokens: Tokens, cache: SlotCache, span: int, width: int) -> torch.Tensor:
        """Score a flat batch of tokens (`Tokens`) on top of their slots' prefixes -> their final states (N,D).

        Token i's keys and values are written at position tokens.pos[i] of slot tokens.rows[i] (past the
        cache's length: its last position, which no live row reaches). It attends to its slot's keys at
        positions <= its own (a double-token model: the end of its pair) within the first `span`, and to
        the first `width` source positions where `cache.src_keep`. No host read; shapes depend only on
        (N, B, T, span, width). Attention (`slot_attention`) reads each token's own keys through the CPU
        kernel where it runs for the cache's dtype; elsewhere `tokens` must hold every position of every
        slot (`Tokens.full`), and attention is masked products on the slot grid."""
        # each token a row of one query (N,1,D), its keys and values written at (slot, position) (N,1) each
        at = (tokens.rows[:, None], tokens.pos.clamp(max=cache.length - 1)[:, None])
        x = self.decoder.embed(tokens.ids[:, None], tokens.pos[:, None])
        self_attend, cross_attend, query = slot_attention(tokens, cache, span, width, self.cfg.double_token)
        biases = self.decoder.position_bias(query, span)  # per token (N,H,1,span) or on the grid, or None
        for i, (layer, bias) in enumerate(zip(self.decoder.layers, biases)):
            sa, ca = layer.self_attn, layer.encoder_attn

            def self_attn(h, i=i, sa=sa, bias=bias):
                q, k, v = sa.qkv(h)
                cache.k[i].index_put_(at, k if k.dtype == cache.k[i].dtype else k.to(cache.k[i].dtype))
                cache.v[i].index_put_(at, v if v.dtype == cache.v[i].dtype else v.to(cache.v[i].dtype))
                return sa.out_proj(self_attend(sa, q, cache.k[i][:, :span], cache.v[i][:, :span], bias=bias))

            def cross_attn(h, i=i, ca=ca):
                return ca.out_proj(cross_attend(ca, ca.q_proj(h), cache.cross_k[i][:, :width],
                                                cache.cross_v[i][:, :width]))

            x = layer(x, self_attn, cross_attn)
        return self._final(x).view(x.shape[0], -1)

    def _final(self, x: torch.Tensor) -> torch.Tensor:
        """The decoder's last layer's states -> the final norm (pre-norm), times `cfg.output_scale`."""
        if self.decoder.layer_norm is not None:
            x = self.decoder.layer_norm(x)
        return x * self.cfg.output_scale if self.cfg.output_scale != 1.0 else x

    @staticmethod
    def _attention(limit: torch.Tensor, span: int, cross_count: torch.Tensor, cross_keep: torch.Tensor | None,
                   ragged: bool) -> tuple:
        """How a decoder call attends: (attend(mha, q, k, v, sees, rows=None, bias=None), self_sees,
        cross_sees). Query [b, t] sees the self-attention keys at positions <= limit[b, t] (B,T) within
        the first `span`, and the first cross_count[b] (B,) source positions, which cross_keep (B,1,1,S)
        marks; `bias` (B,H,T,L) is added to its scores. `ragged`: the CPU kernel (counts; `rows` its
        row map); else masked products (`MultiheadAttention.core`; no row map)."""
        if ragged:
            return kernel_attend, (limit + 1).clamp(max=span), cross_count[:, None].expand_as(limit)
        keep = (torch.arange(span, device=limit.device)[None, None, :] <= limit[:, :, None])[:, None]  # (B,1,T,span)
        return (lambda mha, q, k, v, sees, rows=None, bias=None: mha.core(q, k, v, sees, bias)), keep, cross_keep

    def _default_limit(self, pos: torch.Tensor) -> torch.Tensor:
        """Causal: each position sees itself and before; a double-token model's unit is the pair."""
        return pair_limit(pos) if self.cfg.double_token else pos

    def forward(self, src: torch.Tensor, prev_output_tokens: torch.Tensor, return_hidden: bool = False) -> torch.Tensor:
        """Teacher-forced logits (B,T,V) for training, no cache, causal (hidden states (B,T,D) if `return_hidden`)."""
        memory, src_pad = self.encode(src)
        cross = self.cross_kv(memory, src_pad)
        bsz, t = prev_output_tokens.shape
        pos = torch.arange(t, device=src.device)
        x = self.decoder.embed(prev_output_tokens, pos[None].expand(bsz, t))
        limit = self._default_limit(pos[None].expand(bsz, t))
        causal = (pos[None, None, :] <= limit[:, :, None])[:, None]  # (B,1,T,T)
        cross_keep = (~src_pad)[:, None, None, :]
        biases = self.decoder.position_bias(pos[None], t)  # (1,H,T,T) each, or None
        for i, (layer, bias) in enumerate(zip(self.decoder.layers, biases)):
            sa, ca = layer.self_attn, layer.encoder_attn
            x = layer(x, lambda h, sa=sa, bias=bias: sa.attend(h, sa.k_proj(h), sa.v_proj(h), causal, bias),
                      lambda h, i=i, ca=ca: ca.attend(h, cross.k[i], cross.v[i], cross_keep))
        x = self._final(x)
        return x if return_hidden else self.output_logits(x)
