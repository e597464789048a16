"""Model configuration: every field a fairseq `transformer` checkpoint can vary that we support."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


ACTIVATIONS = ("relu", "gelu", "silu")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and wiring of an encoder-decoder Transformer (fairseq `transformer` family).

    Special token ids default to fairseq's Dictionary: bos=0, pad=1, eos=2, unk=3. The decoder is
    fed `eos` as its first token unless a model's conventions (aggdec.conventions) name another.
    Positions: row `first_position + i` of the position table embeds position i (fairseq and
    M2M100: pad + 1; BART/mBART's learned table: 2; Marian: 0).
    """

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
    activation: str = "relu"  # "relu", "gelu" or "silu" (Marian's "swish")
    dropout: float = 0.1  # training only
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    max_source_positions: int = 1024
    max_target_positions: int = 1024
    bos: int = 0
    pad: int = 1
    eos: int = 2
    unk: int = 3
    first_position: int | None = None  # table row of position 0; None: pad + 1 (fairseq)
    sinusoidal: str = "fairseq"  # sinusoidal table layout: "fairseq" (also M2M100) or "marian"
    output_bias: bool = False  # a bias on the output logits (Marian/BART's final_logits_bias)
    double_token: bool = False  # the decoder emits a (head, tail) token pair per step (aggdec.double_token)

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.sinusoidal not in ("fairseq", "marian"):
            raise ValueError(f"sinusoidal must be 'fairseq' or 'marian', got {self.sinusoidal!r}")
        for name in ("d_model", "enc_heads", "dec_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.d_model % self.enc_heads or self.d_model % self.dec_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by the number of heads")
        if self.double_token and not self.dec_learned_pos:
            raise ValueError("double_token needs dec_learned_pos (a pair's tokens are not adjacent in the sentence)")
        if self.share_all_embeddings and self.src_vocab != self.tgt_vocab:
            raise ValueError("share_all_embeddings needs src_vocab == tgt_vocab")

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
            if name not in d:
                if f.default is dataclasses.MISSING:
                    raise ValueError(f"{name}: missing")
                continue
            value = d[name]
            if value is None and f.type.endswith("| None"):
                continue
            want = types[f.type.removesuffix(" | None")]
            if not isinstance(value, want) or (f.type != "bool" and isinstance(value, bool)):
                raise ValueError(f"{name}: must be {f.type}, got {value!r}")
            if f.type.startswith("int") and value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        return cls(**d)
