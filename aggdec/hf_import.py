"""Hugging Face encoder-decoders as verifiers: a local model directory read without `transformers`.

Families (config.json's `model_type`): marian (OPUS-MT), bart, mbart, m2m_100 (M2M100 and NLLB), t5
(T5 v1.0 and v1.1, Flan-T5, CoEdIT, MADLAD-400), mt5 and umt5. The first four carry fairseq's names under
`model.`, so the weights map onto aggdec's Transformer; they differ in switches that are ModelConfig
fields (pre/post-norm, `layernorm_embedding`, embedding scale, learned positions with BART's offset 2
or a sinusoidal table in fairseq's or Marian's layout, activation, Marian/BART's
`final_logits_bias`, tied or separate embeddings) and in their special-token framing
(aggdec.conventions). T5s (`_t5_name`) set the ModelConfig fields of T5's layout: relative position
buckets, RMS norms before every block and at the end of each stack, no biases, unscaled attention
over heads of `d_kv`, a ReLU or gated GELU-tanh FFN (`feed_forward_proj`), one embedding for both
stacks, the output projection tied to it (decoder states rescaled by d_model ** -0.5 first, as
transformers does where `scale_decoder_outputs` or `tie_word_embeddings` says so; mT5: never) or a
separate `lm_head`; umT5 is T5 with a bias table in every self-attention layer
(`relative_per_layer`); the source is the text + </s>, and the decoder starts from
`decoder_start_token_id` (pad). A T5 has no position limit; aggdec takes `n_positions` (default 512)
as its source and output limit. Tokenizers come from the directory's own files
(aggdec.tokenizers.hf). Greedy decoding of an imported model is token-identical to
`model.generate(num_beams=1, do_sample=False)` of transformers, except that aggdec never emits eos as
the first output token (fairseq's min_len 1) nor the pad token, and decodes with its own length
limits (max_len_a = 0, max_len_b = N gives transformers' `max_new_tokens = N`).

Weights load from model.safetensors without pickle; a pytorch_model.bin is a pickle and needs
`trust=True` (the same rule as fairseq .pt files). Nothing is downloaded: a directory path only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from aggdec.bundle import Bundle, check_vocab, file_sha, save
from aggdec.conventions import Conventions
from aggdec.model.config import HF_FAMILIES, ModelConfig
from aggdec.model.transformer import Transformer
from aggdec.tokenizers.hf import hf_tokenizers

T5_FAMILIES = ("t5", "mt5", "umt5")
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh"}
T5_POSITIONS = 512
"""Source and output positions of a T5 whose config.json has no `n_positions` (T5 has no position
table: a limit on lengths only)."""
LANGUAGE_PATTERNS = {  # how each family writes its language tokens -> the code users give
    "m2m_100": (re.compile(r"^__([a-z]{2,3})__$"), re.compile(r"^([a-z]{3}_[A-Z][a-z]{3})$")),  # M2M100, NLLB
    "mbart": (re.compile(r"^([a-z]{2}_[A-Z]{2})$"),),
}
M2M100_LANGUAGES = {  # M2M100Tokenizer's language tokens __xx__ follow vocab.json, in this order
    "m2m100": ("af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he hi "
               "hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no ns oc "
               "or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh "
               "zu").split(),
    "wmt21": "en ha is ja cs ru zh de".split(),
}
GENERATION_KEYS_IGNORED = ("num_beams", "no_repeat_ngram_size", "length_penalty", "min_length", "repetition_penalty",
                           "bad_words_ids", "max_length", "early_stopping")


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must be a JSON object")
    return data


def _model_type(d: Path, hf: dict) -> str:
    kind = hf.get("model_type")
    if kind not in HF_FAMILIES:
        raise ValueError(f"{d / 'config.json'}: model_type {kind!r} is not supported; supported: "
                         f"{', '.join(HF_FAMILIES)} (NLLB is m2m_100)")
    return kind


def _needs(d: Path, hf: dict):
    def need(key: str):
        if key not in hf:
            raise ValueError(f"{d / 'config.json'}: {key}: missing")
        return hf[key]
    return need


def model_config(d: Path, hf: dict, weights: dict[str, torch.Tensor]) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json of a supported family."""
    kind = _model_type(d, hf)
    if kind in T5_FAMILIES:
        return t5_config(d, hf, weights, kind)
    where = d / "config.json"
    need = _needs(d, hf)
    act = need("activation_function")
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: activation_function {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    vocab = need("vocab_size")
    tgt_vocab = (hf.get("decoder_vocab_size") or vocab) if kind == "marian" else vocab
    shared = hf.get("share_encoder_decoder_embeddings", True) if kind == "marian" else True
    tied = "lm_head.weight" not in weights and hf.get("tie_word_embeddings", True)
    if "lm_head.weight" in weights:  # saved although tied when it equals the decoder's embedding
        emb = weights.get("model.decoder.embed_tokens.weight", weights.get("model.shared.weight"))
        tied = emb is not None and emb.shape == weights["lm_head.weight"].shape and torch.equal(emb, weights["lm_head.weight"])
    bias = weights.get("final_logits_bias")
    eos, pad = need("eos_token_id"), need("pad_token_id")
    bos = hf.get("bos_token_id")
    pre = kind in ("mbart", "m2m_100")
    return ModelConfig(
        src_vocab=vocab, tgt_vocab=tgt_vocab, d_model=need("d_model"),
        enc_layers=need("encoder_layers"), dec_layers=need("decoder_layers"),
        enc_heads=need("encoder_attention_heads"), dec_heads=need("decoder_attention_heads"),
        enc_ffn=need("encoder_ffn_dim"), dec_ffn=need("decoder_ffn_dim"),
        enc_normalize_before=pre, dec_normalize_before=pre,
        enc_learned_pos=kind in ("bart", "mbart"), dec_learned_pos=kind in ("bart", "mbart"),
        layernorm_embedding=kind in ("bart", "mbart"),
        no_scale_embedding=not hf.get("scale_embedding", False),
        share_all_embeddings=shared and tgt_vocab == vocab,
        share_decoder_input_output_embed=tied,
        activation=ACTIVATIONS[act], dropout=0.0,
        max_source_positions=need("max_position_embeddings"), max_target_positions=need("max_position_embeddings"),
        bos=eos if bos is None else bos, pad=pad, eos=eos, unk=_unk(d, kind),
        first_position={"marian": 0, "bart": 2, "mbart": 2}.get(kind),
        sinusoidal="marian" if kind == "marian" else "fairseq",
        output_bias=bias is not None and bool(bias.abs().max() > 0),
    )


def t5_config(d: Path, hf: dict, weights: dict[str, torch.Tensor], kind: str) -> ModelConfig:
    """The ModelConfig of a T5, mT5 or umT5 config.json (module docstring)."""
    where = d / "config.json"
    need = _needs(d, hf)
    proj = hf.get("feed_forward_proj", "relu" if kind == "t5" else "gated-gelu")
    parts = proj.split("-")
    act = hf.get("dense_act_fn") or ("gelu_new" if proj == "gated-gelu" else parts[-1])
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated") or act not in ACTIVATIONS:
        raise ValueError(f"{where}: feed_forward_proj {proj!r} is not supported (relu, gated-gelu, gated-silu, ...)")
    head = weights.get("lm_head.weight")
    emb = next((weights[k] for k in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
                if k in weights), None)
    tied = head is None or (emb is not None and emb.shape == head.shape and torch.equal(head, emb))
    if kind == "mt5":  # transformers' MT5ForConditionalGeneration never rescales
        scale = False
    else:
        scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
    layers, heads, d_model = need("num_layers"), need("num_heads"), need("d_model")
    positions = hf.get("n_positions") or T5_POSITIONS
    pad, eos = need("pad_token_id"), need("eos_token_id")
    return ModelConfig(
        src_vocab=need("vocab_size"), tgt_vocab=need("vocab_size"), d_model=d_model,
        enc_layers=layers, dec_layers=hf.get("num_decoder_layers") or layers, enc_heads=heads, dec_heads=heads,
        enc_ffn=need("d_ff"), dec_ffn=need("d_ff"), enc_normalize_before=True, dec_normalize_before=True,
        no_scale_embedding=True, share_all_embeddings=True, share_decoder_input_output_embed=tied,
        untied_output=not tied,
        activation=ACTIVATIONS[act], gated_ffn=parts[0] == "gated", linear_bias=False, norm="rms",
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), head_dim=need("d_kv"), attention_scale=False,
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        relative_per_layer=kind == "umt5", output_scale=d_model**-0.5 if scale else 1.0, dropout=0.0,
        max_source_positions=positions, max_target_positions=positions,
        bos=eos, pad=pad, eos=eos, unk=_added_tokens(d).get("<unk>", 2),
    )


T5_LAYERS = {"SelfAttention": "self_attn", "EncDecAttention": "encoder_attn"}
T5_PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj", "wi": "fc1", "wi_0": "fc1",
                  "wi_1": "fc3", "wo": "fc2"}
T5_NORMS = {"encoder": ("self_attn_layer_norm", "final_layer_norm"),
            "decoder": ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")}
T5_UNUSED = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"  # older checkpoints; never read


def _t5_name(name: str) -> str | None:
    """A T5 tensor name -> aggdec's (None: not a parameter aggdec keeps); unknown names unchanged
    (`state_dict` names them)."""
    if name == T5_UNUSED:
        return None
    if name in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        return "encoder.embed_tokens.weight"  # one embedding; copies must equal it (`state_dict`)
    if name == "lm_head.weight":
        return "decoder.output_projection.weight"
    m = re.fullmatch(r"(encoder|decoder)\.final_layer_norm\.weight", name)
    if m:
        return f"{m.group(1)}.layer_norm.weight"
    m = re.fullmatch(r"(encoder|decoder)\.block\.(\d+)\.layer\.(\d+)\.(.+)", name)
    if not m:
        return name
    side, i, sub, rest = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
    if rest == "layer_norm.weight" and sub < len(T5_NORMS[side]):
        return f"{side}.layers.{i}.{T5_NORMS[side][sub]}.weight"
    m = re.fullmatch(r"(SelfAttention|EncDecAttention|DenseReluDense)\.(\w+)\.weight", rest)
    if not m:
        return name
    if m.group(2) == "relative_attention_bias":
        return f"{side}.relative_attention_bias.{i}.weight"
    if m.group(1) == "DenseReluDense":
        return f"{side}.layers.{i}.{T5_PROJECTIONS.get(m.group(2), m.group(2))}.weight"
    return f"{side}.layers.{i}.{T5_LAYERS[m.group(1)]}.{T5_PROJECTIONS.get(m.group(2), m.group(2))}.weight"


def _unk(d: Path, kind: str) -> int:
    vocab = _json(d / "vocab.json")
    if "<unk>" in vocab:
        return vocab["<unk>"]
    return 1 if kind == "marian" else 3


def read_weights(d: Path, *, trust: bool = False) -> tuple[dict[str, torch.Tensor], Path]:
    """{name: tensor} from model.safetensors, or from pytorch_model.bin (a pickle) when `trust`."""
    st, pt = d / "model.safetensors", d / "pytorch_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(st)), st
        except Exception as e:  # safetensors raises several types for truncated/corrupt files
            raise ValueError(f"{st}: cannot read weights ({e})") from e
    if pt.is_file():
        if not trust:
            raise PermissionError(f"{pt}: a pickle, which can run code when loaded; pass --trust-checkpoint "
                                  "(trust=True) if you trust its source, or save it as model.safetensors")
        return torch.load(pt, map_location="cpu", weights_only=True), pt
    sharded = sorted(d.glob("model-*.safetensors"))
    if sharded:
        raise ValueError(f"{d}: sharded weights ({sharded[0].name}, ...) are not supported; save with one file")
    raise FileNotFoundError(f"{d}: no model.safetensors or pytorch_model.bin")


def _our_name(name: str) -> str | None:
    """A Hugging Face tensor name -> aggdec's (None: not a parameter aggdec keeps)."""
    if name == "final_logits_bias":
        return "decoder.output_bias"
    if name == "lm_head.weight":
        return "decoder.output_projection.weight"
    if name == "model.shared.weight":
        return "encoder.embed_tokens.weight"
    if name.startswith("model."):
        return name[len("model."):]
    return name


def state_dict(cfg: ModelConfig, weights: dict[str, torch.Tensor], source: Path,
               kind: str = "bart") -> dict[str, torch.Tensor]:
    """Map `weights` of a `kind` model onto Transformer(cfg)'s parameters; errors name the tensor at
    fault."""
    want = Transformer(cfg).state_dict()
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for name, tensor in weights.items():
        ours = _t5_name(name) if kind in T5_FAMILIES else _our_name(name)
        if ours is None:
            continue
        if ours.endswith("embed_positions.weight") and not (cfg.enc_learned_pos or cfg.dec_learned_pos):
            continue  # a sinusoidal table saved by older versions: computed, not loaded
        if ours == "decoder.output_bias":
            if not cfg.output_bias:
                continue  # all zeros
            tensor = tensor.reshape(-1)
        if ours == "decoder.output_projection.weight" and cfg.share_decoder_input_output_embed:
            continue
        if ours in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight") and cfg.share_all_embeddings:
            if ours in out and not torch.equal(out[ours], tensor):
                raise ValueError(f"{source}: {name} differs from the shared embedding although the config shares them")
            ours = "encoder.embed_tokens.weight"
        if ours not in want:
            raise ValueError(f"{source}: unexpected tensor {name} (not part of a {cfg_summary(cfg)} model)")
        if tuple(tensor.shape) != tuple(want[ours].shape):
            raise ValueError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies "
                             f"{tuple(want[ours].shape)}")
        out[ours], origin[ours] = tensor, name
    if cfg.share_all_embeddings and "decoder.embed_tokens.weight" in want:
        out["decoder.embed_tokens.weight"] = out.get("encoder.embed_tokens.weight")
    missing = [k for k in want if out.get(k) is None]
    if missing:
        raise ValueError(f"{source}: missing tensor(s) for {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''} (config.json and the weights disagree)")
    return out


def cfg_summary(cfg: ModelConfig) -> str:
    return f"{cfg.enc_layers}+{cfg.dec_layers}-layer d{cfg.d_model}"


def _languages(kind: str, tokens: dict[str, int]) -> dict[str, int]:
    out = {}
    for pattern in LANGUAGE_PATTERNS.get(kind, ()):
        for tok, i in tokens.items():
            m = pattern.match(tok)
            if m:
                out[m.group(1)] = i
    return out


def _added_tokens(d: Path) -> dict[str, int]:
    """Added (special) tokens of the directory's tokenizer: tokenizer.json's added_tokens or
    tokenizer_config.json's added_tokens_decoder."""
    out = {t["content"]: t["id"] for t in _json(d / "tokenizer.json").get("added_tokens", [])}
    for i, t in _json(d / "tokenizer_config.json").get("added_tokens_decoder", {}).items():
        out.setdefault(t["content"], int(i))
    return out


def tokenizer_spec(d: Path, kind: str, cfg: ModelConfig, added: dict[str, int]) -> tuple[dict, list[str]]:
    """(config.json tokenizer entry, files to copy) for the directory's tokenizer files; `added`: its
    added tokens (`_added_tokens`)."""
    tc = _json(d / "tokenizer_config.json")
    cleanup = bool(tc.get("clean_up_tokenization_spaces", False))
    if kind == "marian":
        files = ["source.spm", "target.spm", "vocab.json"]
        separate = bool(tc.get("separate_vocabs", False))
        if separate:
            files.append("target_vocab.json")
        _require(d, files, kind)
        vocab = _json(d / "vocab.json")
        specials = [vocab[t] for t in ("</s>", "<pad>", "<unk>") if t in vocab]
        return ({"type": "hf-pieces", "src_spm": "source.spm", "tgt_spm": "target.spm", "src_vocab": "vocab.json",
                 "tgt_vocab": "target_vocab.json" if separate else "vocab.json",
                 "decode_spm": "target.spm" if separate else "source.spm",  # as MarianTokenizer.decode
                 "unk": cfg.unk, "specials": specials, "cleanup": cleanup}, files)
    if (d / "tokenizer.json").is_file():
        return ({"type": "hf-tokenizers", "file": "tokenizer.json", "unk": added.get("<unk>"), "cleanup": cleanup},
                ["tokenizer.json"])
    if kind in T5_FAMILIES:
        _require(d, ["spiece.model"], kind)
        sentinels = [t for t in tc.get("additional_special_tokens") or [] if str(t).startswith("<extra_id_")]
        extra = (tc["extra_ids"] or len(sentinels)) if "extra_ids" in tc else (len(sentinels) or 100)
        return {"type": "hf-spiece", "file": "spiece.model", "extra_ids": extra, "cleanup": cleanup}, ["spiece.model"]
    if kind == "m2m_100":
        files = ["sentencepiece.bpe.model", "vocab.json"]
        _require(d, files, kind)
        vocab = _json(d / "vocab.json")
        codes = M2M100_LANGUAGES.get(tc.get("language_codes", "m2m100"))
        if codes is None:
            raise ValueError(f"{d / 'tokenizer_config.json'}: language_codes {tc.get('language_codes')!r} is not "
                             f"one of {', '.join(M2M100_LANGUAGES)}")
        added = {**{f"__{c}__": len(vocab) + i for i, c in enumerate(codes)}, **added}
        specials = sorted({*added.values(), *(vocab[t] for t in ("<s>", "</s>", "<pad>", "<unk>") if t in vocab)})
        return ({"type": "hf-pieces", "src_spm": files[0], "tgt_spm": files[0], "src_vocab": "vocab.json",
                 "tgt_vocab": "vocab.json", "unk": cfg.unk, "specials": specials, "cleanup": cleanup,
                 "added": added}, files)
    raise ValueError(f"{d}: no tokenizer.json (a {kind} model's tokenizer is read from it; save the tokenizer "
                     "with transformers' save_pretrained)")


def _require(d: Path, files: list[str], kind: str) -> None:
    lacking = [f for f in files if not (d / f).is_file()]
    if lacking:
        raise FileNotFoundError(f"{d}: a {kind} model directory needs {', '.join(lacking)} (tokenizer files)")


def conventions(d: Path, kind: str, hf: dict, tokens: dict[str, int]) -> tuple[Conventions, dict]:
    """(the family's framing, generation settings aggdec does not apply) from config.json,
    generation_config.json and tokenizer_config.json."""
    gen = {**{k: v for k, v in hf.items() if k in ("decoder_start_token_id", "forced_bos_token_id")},
           **_json(d / "generation_config.json")}
    tc = _json(d / "tokenizer_config.json")
    langs = _languages(kind, tokens)
    start = gen.get("decoder_start_token_id")
    forced_bos = gen.get("forced_bos_token_id")
    src_lang, tgt_lang = tc.get("src_lang"), tc.get("tgt_lang")
    if kind in ("marian", *T5_FAMILIES):  # text </s>; the decoder starts from pad
        conv = Conventions(decoder_start=start if start is not None else hf["pad_token_id"])
    elif kind == "bart":
        conv = Conventions(source_prefix=(hf.get("bos_token_id", 0),), decoder_start=start,
                           forced=(forced_bos,) if forced_bos is not None else ())
    elif kind == "mbart" and "50" not in str(tc.get("tokenizer_class", "")):  # mBART-cc25: text </s> src_lang
        conv = Conventions(source_suffix=(hf["eos_token_id"], "source_lang"), decoder_start="target_lang",
                           languages=langs, source_lang=src_lang, target_lang=tgt_lang)
    else:  # M2M100, NLLB, mBART-50: src_lang text </s>; decoder </s>, forced tgt_lang
        conv = Conventions(source_prefix=("source_lang",), decoder_start=start, forced=("target_lang",),
                           languages=langs, source_lang=src_lang, target_lang=tgt_lang)
    ignored = {k: gen[k] for k in GENERATION_KEYS_IGNORED if gen.get(k) not in (None, 0, 1.0, False, [])}
    if ignored.get("bad_words_ids") == [[hf["pad_token_id"]]]:  # Marian's "never pad": aggdec never emits pad
        del ignored["bad_words_ids"]
    return conv, ignored


def _prepare(d: Path, *, trust: bool):
    hf = _json(d / "config.json")
    if not hf:
        raise FileNotFoundError(f"{d}: not a model directory (no config.json)")
    kind = _model_type(d, hf)
    weights, source = read_weights(d, trust=trust)
    cfg = model_config(d, hf, weights)
    added = _added_tokens(d)  # language codes are added tokens in every family's tokenizer
    spec, files = tokenizer_spec(d, kind, cfg, added)
    conv, ignored = conventions(d, kind, hf, spec.get("added", added))
    meta = {"source": "transformers", "model_type": kind, "generation_config_ignored": ignored}
    return cfg, state_dict(cfg, weights, source, kind), spec, files, conv, meta, source


def _model(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> Transformer:
    model = Transformer(cfg)
    model.load_state_dict({k: v.float() for k, v in params.items()}, strict=True)
    return model


def load(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
         trust: bool = False) -> Bundle:
    """A Hugging Face model directory as a Bundle, in memory (same result as `convert` then
    checkpoint.load, except that the weights keep their stored precision)."""
    d = Path(path)
    cfg, params, spec, _, conv, meta, source = _prepare(d, trust=trust)
    src_tok, tgt_tok = hf_tokenizers(d, spec)
    check_vocab(cfg, src_tok, tgt_tok, str(d), exact=False)
    model = _model(cfg, params).to(device=device, dtype=dtype).eval()
    return Bundle(model=model, src_tok=src_tok, tgt_tok=tgt_tok, path=d, meta=meta, sha=file_sha(source),
                  conventions=conv)


def convert(path: str | Path, out_dir: str | Path, *, trust: bool = False, dtype: torch.dtype = torch.float32) -> Path:
    """Write a Hugging Face model directory in the project's format (config.json with the model's
    conventions, model.safetensors, its tokenizer files)."""
    d = Path(path)
    cfg, params, spec, files, conv, meta, _ = _prepare(d, trust=trust)
    check_vocab(cfg, *hf_tokenizers(d, spec), str(d), exact=False)
    return save(out_dir, _model(cfg, params), spec, {f: d / f for f in files}, dtype=dtype, meta=meta,
                conventions=conv)
