"""Model configuration: every field a fairseq `transformer` checkpoint can vary that we support, and
the switches of the imported Hugging Face families (aggdec.hf_import)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

HF_FAMILIES = ("marian", "bart", "mbart", "m2m_100", "t5", "mt5", "umt5")
"""The Hugging Face `model_type`s that import (aggdec.hf_import); NLLB is m2m_100."""

PRECISIONS = ("fp32", "bf16", "int8")
"""The precisions a verifier runs at (aggdec.model.precision; the `precision` option)."""
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
NORMS = ("layer", "rms")
SINUSOIDAL = ("fairseq", "marian")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and wiring of an encoder-decoder Transformer (fairseq `transformer` family). Special token
    ids default to fairseq's Dictionary; the decoder starts from `eos` unless a model's conventions
    (aggdec.conventions) name another token."""

    src_vocab: int  # rows of encoder.embed_tokens
    tgt_vocab: int  # rows of decoder.embed_tokens / output projection
    d_model: int = 512  # encoder and decoder embedding dim (must be equal)
    enc_layers: int = 6
    dec_layers: int = 6
    enc_heads: int = 8
    dec_heads: int = 8
    enc_ffn: int = 2048
    dec_ffn: int = 2048
    enc_normalize_before: bool = False  # pre-norm encoder (adds a final encoder layer_norm)
    dec_normalize_before: bool = False  # pre-norm decoder (adds a final decoder layer_norm)
    enc_learned_pos: bool = False  # learned vs sinusoidal positions
    dec_learned_pos: bool = False
    layernorm_embedding: bool = False  # LayerNorm after embeddings + positions
    no_scale_embedding: bool = False  # fairseq scales token embeddings by sqrt(d_model) unless set
    share_all_embeddings: bool = False  # encoder and decoder share one embedding matrix
    share_decoder_input_output_embed: bool = False  # output projection tied to decoder embeddings
    untied_output: bool = False  # an output projection of its own despite share_all_embeddings (T5 v1.1's lm_head)
    activation: str = "relu"  # "relu", "gelu", "gelu_tanh" (tanh approximation) or "silu" (Marian's "swish")
    gated_ffn: bool = False  # FFN fc2(act(fc1(x)) * fc3(x)) (T5 v1.1, Flan-T5, mT5) instead of fc2(act(fc1(x)))
    linear_bias: bool = True  # attention and FFN projections have biases (T5: none)
    norm: str = "layer"  # "layer" (LayerNorm) or "rms" (T5's: no mean subtracted, no bias, variance in fp32)
    norm_eps: float = 1e-5
    head_dim: int | None = None  # size of each attention head (T5's d_kv); None: d_model / heads
    attention_scale: bool = True  # attention scores scaled by head_dim ** -0.5 (T5: unscaled)
    relative_buckets: int = 0  # T5's relative position bias: its buckets; 0: none (absolute positions instead)
    relative_max_distance: int = 128  # distances from this one on share the last bucket
    relative_per_layer: bool = False  # a bias table in every self-attention layer (umT5), not one per stack
    output_scale: float = 1.0  # final decoder states times this before the output projection (tied T5: d_model**-0.5)
    dropout: float = 0.1  # training only
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    max_source_positions: int = 1024
    max_target_positions: int = 1024
    bos: int = 0
    pad: int = 1
    eos: int = 2
    unk: int = 3
    first_position: int | None = None  # table row of position 0; None: pad + 1 (fairseq, M2M100; BART: 2, Marian: 0)
    sinusoidal: str = "fairseq"  # sinusoidal table layout: "fairseq" (also M2M100) or "marian"
    output_bias: bool = False  # a bias on the output logits (Marian/BART's final_logits_bias)
    double_token: bool = False  # the decoder emits a (head, tail) token pair per step (aggdec.double_token)

    def __post_init__(self) -> None:
        for name, allowed in (("activation", ACTIVATIONS), ("sinusoidal", SINUSOIDAL), ("norm", NORMS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("d_model", "enc_heads", "dec_heads", "head_dim"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.head_dim is None and (self.d_model % self.enc_heads or self.d_model % self.dec_heads):
            raise ValueError(f"d_model={self.d_model} is not divisible by the number of heads")
        if self.relative_buckets and (self.enc_learned_pos or self.dec_learned_pos or self.double_token):
            raise ValueError("relative_buckets replaces absolute positions: no learned positions, no double_token")
        if self.double_token and not self.dec_learned_pos:
            raise ValueError("double_token needs dec_learned_pos (a pair's tokens are not adjacent in the sentence)")
        if self.share_all_embeddings and self.src_vocab != self.tgt_vocab:
            raise ValueError("share_all_embeddings needs src_vocab == tgt_vocab")

    def inner_dim(self, heads: int) -> int:
        """Width of the queries, keys and values of an attention with `heads` heads."""
        return heads * self.head_dim if self.head_dim is not None else self.d_model

    @property
    def position_offset(self) -> int:
        """Row of the position table that embeds position 0."""
        return self.pad + 1 if self.first_position is None else self.first_position

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Validated: raises ValueError naming the field for an unknown or missing field or a value of
        the wrong type."""
        if not isinstance(d, dict):
            raise ValueError(f"must be an object of model fields, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(d) - set(fields)
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        types = {"int": int, "float": (int, float), "bool": bool, "str": str}
        for name, f in fields.items():
            if name not in d and f.default is dataclasses.MISSING:
                raise ValueError(f"{name}: missing")
            value = d.get(name)
            if name not in d or (value is None and f.type.endswith("| None")):
                continue
            want = types[f.type.removesuffix(" | None")]
            if not isinstance(value, want) or (f.type != "bool" and isinstance(value, bool)):
                raise ValueError(f"{name}: must be {f.type}, got {value!r}")
            if f.type.startswith("int") and value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        return cls(**d)
