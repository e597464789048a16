"""fairseq checkpoints <-> the project's model format, without importing fairseq (torch only).

- `load_fairseq`: a fairseq `transformer`-family checkpoint (.pt, a pickle: needs trust=True) plus
  its data dir (dictionaries) -> a ready `Bundle`.
- `convert_fairseq`: the same, written as a project-format model directory (safetensors).
- `save_fairseq`: a project model -> `checkpoint.pt` + `dict.src.txt`/`dict.tgt.txt` that
  `fairseq-generate DATA --path checkpoint.pt --source-lang src --target-lang tgt` and
  CTranslate2's fairseq converter load.

The architecture fields follow fairseq 0.12's `transformer_legacy.py`: missing fields get the
named architecture's defaults, as fairseq's `base_architecture` and friends would set them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aggdec.bundle import Bundle, check_vocab, file_sha
from aggdec.bundle import save as save_project
from aggdec.checkpoint import load as load_project
from aggdec.conventions import Conventions
from aggdec.model.config import ModelConfig
from aggdec.model.transformer import Transformer
from aggdec.tokenizers import DictionaryTokenizer, SentencePieceTokenizer, Tokenizer
from aggdec.tokenizers.dictionary import SPECIALS, Dictionary

TRUST_MESSAGE = ("{path}: a fairseq .pt checkpoint is a Python pickle, and loading it can run arbitrary code. "
                 "Pass --trust-checkpoint (trust=True) only if the file comes from a trusted source.")

# -- fairseq architecture defaults (fairseq/models/transformer/transformer_legacy.py, 0.12) ---------


def _base(a: dict) -> None:
    d = a.setdefault
    d("encoder_embed_path", None)
    d("encoder_embed_dim", 512)
    d("encoder_ffn_embed_dim", 2048)
    d("encoder_layers", 6)
    d("encoder_attention_heads", 8)
    d("encoder_normalize_before", False)
    d("encoder_learned_pos", False)
    d("decoder_embed_path", None)
    d("decoder_embed_dim", a["encoder_embed_dim"])
    d("decoder_ffn_embed_dim", a["encoder_ffn_embed_dim"])
    d("decoder_layers", 6)
    d("decoder_attention_heads", 8)
    d("decoder_normalize_before", False)
    d("decoder_learned_pos", False)
    d("attention_dropout", 0.0)
    d("activation_dropout", 0.0)
    d("activation_fn", "relu")
    d("dropout", 0.1)
    d("adaptive_softmax_cutoff", None)
    d("adaptive_softmax_dropout", 0)
    d("share_decoder_input_output_embed", False)
    d("share_all_embeddings", False)
    d("merge_src_tgt_embed", False)
    d("no_token_positional_embeddings", False)
    d("adaptive_input", False)
    d("no_cross_attention", False)
    d("cross_self_attention", False)
    d("decoder_output_dim", a["decoder_embed_dim"])
    d("decoder_input_dim", a["decoder_embed_dim"])
    d("no_scale_embedding", False)
    d("layernorm_embedding", False)
    d("tie_adaptive_weights", False)
    d("checkpoint_activations", False)
    d("offload_activations", False)
    d("encoder_layers_to_keep", None)
    d("decoder_layers_to_keep", None)
    d("encoder_layerdrop", 0)
    d("decoder_layerdrop", 0)
    d("quant_noise_pq", 0)
    d("quant_noise_pq_block_size", 8)
    d("quant_noise_scalar", 0)


def _defaults(**kw) -> Callable[[dict], None]:
    def apply(a: dict) -> None:
        for k, v in kw.items():
            a.setdefault(k, v)
    return apply


def _chain(*fns: Callable[[dict], None]) -> Callable[[dict], None]:
    def apply(a: dict) -> None:
        for f in fns:
            f(a)
    return apply


_BIG = _defaults(encoder_embed_dim=1024, encoder_ffn_embed_dim=4096, encoder_attention_heads=16,
                 encoder_normalize_before=False, decoder_embed_dim=1024, decoder_ffn_embed_dim=4096,
                 decoder_attention_heads=16, dropout=0.3)
_ALIGN = _defaults(alignment_heads=1, alignment_layer=4, full_context_alignment=False)
ARCHS: dict[str, Callable[[dict], None]] = {
    "transformer": _base,
    "transformer_tiny": _chain(_defaults(encoder_embed_dim=64, encoder_ffn_embed_dim=64, encoder_layers=2,
                                         encoder_attention_heads=2, decoder_layers=2, decoder_attention_heads=2), _base),
    "transformer_iwslt_de_en": _chain(_defaults(encoder_embed_dim=512, encoder_ffn_embed_dim=1024,
                                                encoder_attention_heads=4, encoder_layers=6, decoder_embed_dim=512,
                                                decoder_ffn_embed_dim=1024, decoder_attention_heads=4,
                                                decoder_layers=6), _base),
    "transformer_wmt_en_de": _base,
    "transformer_vaswani_wmt_en_de_big": _chain(_BIG, _base),
    "transformer_vaswani_wmt_en_fr_big": _chain(_defaults(dropout=0.1), _BIG, _base),
    "transformer_wmt_en_de_big": _chain(_defaults(attention_dropout=0.1), _BIG, _base),
    "transformer_wmt_en_de_big_t2t": _chain(_defaults(encoder_normalize_before=True, decoder_normalize_before=True,
                                                      attention_dropout=0.1, activation_dropout=0.1), _BIG, _base),
    "transformer_align": _chain(_ALIGN, _base),
    "transformer_wmt_en_de_big_align": _chain(_ALIGN, _defaults(attention_dropout=0.1), _BIG, _base),
}

# -- reading a checkpoint --------------------------------------------------------------------------


def _as_dict(obj: Any) -> dict | None:
    """argparse.Namespace, dict or omegaconf DictConfig (duck-typed) -> plain dict (one level)."""
    if obj is None:
        return None
    if isinstance(obj, argparse.Namespace):
        return dict(vars(obj))
    if isinstance(obj, dict):
        return dict(obj)
    if hasattr(obj, "items"):
        try:
            return {k: v for k, v in obj.items()}
        except Exception:  # omegaconf raises on missing mandatory values ("???")
            return {k: getattr(obj, k, None) for k in obj.keys()}
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    return None


def _flatten_model_cfg(m: dict) -> dict:
    """New-style (hydra) transformer configs nest `encoder: {embed_dim, ...}`: flatten to legacy names."""
    out = dict(m)
    for side in ("encoder", "decoder"):
        sub = _as_dict(m.get(side)) if not isinstance(m.get(side), (str, type(None))) else None
        if sub:
            out.pop(side, None)
            for k, v in sub.items():
                out.setdefault(f"{side}_{k}", v)
    return out


def _read_pickle(path: Path, trust: bool) -> dict:
    if not trust:
        raise PermissionError(TRUST_MESSAGE.format(path=path))
    if not path.is_file():
        raise FileNotFoundError(f"fairseq checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except ModuleNotFoundError as e:
        raise ValueError(f"{path}: unpickling needs the Python module {e.name!r}, which is not installed") from e
    except Exception as e:  # truncated/corrupt files raise many types
        raise ValueError(f"{path}: cannot read the fairseq checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{path}: not a fairseq checkpoint (no 'model' state dict)")
    return state


def _model_args(state: dict, path: Path) -> tuple[dict, dict]:
    """-> (model fields with architecture defaults applied, task fields)."""
    cfg = _as_dict(state.get("cfg"))
    args = _as_dict(state.get("args"))
    model = _as_dict(cfg.get("model")) if cfg else None
    task = _as_dict(cfg.get("task")) if cfg else None
    if model is None:
        if args is None:
            raise ValueError(f"{path}: the checkpoint has neither cfg['model'] nor legacy 'args'")
        model, task = dict(args), dict(args)
    task = task or {}
    model = _flatten_model_cfg(model)
    if "max_positions" in model and "max_source_positions" not in model:  # very old checkpoints
        model["max_source_positions"] = model["max_target_positions"] = model["max_positions"]
    arch = model.get("arch") or model.get("_name")
    if arch not in ARCHS:
        raise ValueError(f"{path}: unsupported fairseq architecture {arch!r} (field 'arch'); supported: "
                         f"{', '.join(sorted(ARCHS))}")
    ARCHS[arch](model)
    for key in ("max_source_positions", "max_target_positions"):
        if model.get(key) is None:
            model[key] = task.get(key) or 1024
    model["arch"] = arch
    return model, task


def _config_from_args(a: dict, sd: dict, path: Path) -> ModelConfig:
    def refuse(field: str, why: str):
        raise ValueError(f"{path}: unsupported fairseq model option {field}={a.get(field)!r}: {why}")

    if a.get("adaptive_input"):
        refuse("adaptive_input", "adaptive input embeddings are not supported")
    if a.get("adaptive_softmax_cutoff") not in (None, "", [], 0):
        refuse("adaptive_softmax_cutoff", "adaptive softmax is not supported")
    if a.get("tie_adaptive_weights"):
        refuse("tie_adaptive_weights", "adaptive softmax is not supported")
    if a.get("cross_self_attention"):
        refuse("cross_self_attention", "cross+self attention is not supported")
    if a.get("no_cross_attention"):
        refuse("no_cross_attention", "a decoder without cross-attention is not supported")
    if a.get("no_token_positional_embeddings"):
        refuse("no_token_positional_embeddings", "models without positional embeddings are not supported")
    for side in ("encoder", "decoder"):
        if a.get(f"{side}_layers_to_keep"):
            refuse(f"{side}_layers_to_keep", "layer pruning at load time is not supported")
    if a["decoder_input_dim"] != a["decoder_embed_dim"]:
        refuse("decoder_input_dim", f"differs from decoder_embed_dim={a['decoder_embed_dim']} (project_in_dim)")
    if a["decoder_output_dim"] != a["decoder_embed_dim"]:
        refuse("decoder_output_dim", f"differs from decoder_embed_dim={a['decoder_embed_dim']} (project_out_dim)")
    if a["encoder_embed_dim"] != a["decoder_embed_dim"]:
        refuse("decoder_embed_dim", f"differs from encoder_embed_dim={a['encoder_embed_dim']}")
    act = a.get("activation_fn") or "relu"
    if act not in ("relu", "gelu"):
        refuse("activation_fn", "only relu and gelu are supported")
    for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        if key not in sd:
            raise ValueError(f"{path}: the state dict has no {key}")
    d = int(a["encoder_embed_dim"])
    if sd["encoder.embed_tokens.weight"].shape[1] != d:
        raise ValueError(f"{path}: encoder.embed_tokens.weight has dim {sd['encoder.embed_tokens.weight'].shape[1]}, "
                         f"but encoder_embed_dim={d}")
    for side, pre in (("encoder", "encoder_normalize_before"), ("decoder", "decoder_normalize_before")):
        if a.get(pre) and f"{side}.layer_norm.weight" not in sd:
            raise ValueError(f"{path}: {pre}=True but the checkpoint has no {side}.layer_norm (an old fairseq "
                             "version without the final layer norm; not supported)")
    share_all = bool(a.get("share_all_embeddings"))
    return ModelConfig(
        src_vocab=int(sd["encoder.embed_tokens.weight"].shape[0]),
        tgt_vocab=int(sd["decoder.embed_tokens.weight"].shape[0]),
        d_model=d,
        enc_layers=int(a["encoder_layers"]), dec_layers=int(a["decoder_layers"]),
        enc_heads=int(a["encoder_attention_heads"]), dec_heads=int(a["decoder_attention_heads"]),
        enc_ffn=int(a["encoder_ffn_embed_dim"]), dec_ffn=int(a["decoder_ffn_embed_dim"]),
        enc_normalize_before=bool(a["encoder_normalize_before"]), dec_normalize_before=bool(a["decoder_normalize_before"]),
        enc_learned_pos=bool(a["encoder_learned_pos"]), dec_learned_pos=bool(a["decoder_learned_pos"]),
        layernorm_embedding=bool(a.get("layernorm_embedding")), no_scale_embedding=bool(a.get("no_scale_embedding")),
        share_all_embeddings=share_all,
        share_decoder_input_output_embed=bool(a.get("share_decoder_input_output_embed")),  # implied by share_all
        activation=act,
        dropout=float(a.get("dropout") or 0.0), attention_dropout=float(a.get("attention_dropout") or 0.0),
        activation_dropout=float(a.get("activation_dropout") or 0.0),
        max_source_positions=int(a["max_source_positions"]), max_target_positions=int(a["max_target_positions"]),
    )


def _upgrade_state_dict(sd: dict, cfg: ModelConfig) -> dict:
    """fairseq's upgrades for old key names; drop what our model does not hold."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".version") or k.endswith("_float_tensor"):
            continue
        out[k] = v
    for side, names in (("encoder", ("self_attn_layer_norm", "final_layer_norm")),
                        ("decoder", ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"))):
        n_layers = cfg.enc_layers if side == "encoder" else cfg.dec_layers
        for i in range(n_layers):
            for old, new in enumerate(names):
                for m in ("weight", "bias"):
                    key = f"{side}.layers.{i}.layer_norms.{old}.{m}"
                    if key in out:
                        out[f"{side}.layers.{i}.{new}.{m}"] = out.pop(key)
    for k in [k for k in out if k.endswith(".in_proj_weight") or k.endswith(".in_proj_bias")]:
        prefix, kind = k.rsplit(".in_proj_", 1)
        q, kk, v = out.pop(k).chunk(3, dim=0)
        out[f"{prefix}.q_proj.{kind}"], out[f"{prefix}.k_proj.{kind}"], out[f"{prefix}.v_proj.{kind}"] = q, kk, v
    if "decoder.embed_out" in out and "decoder.output_projection.weight" not in out:
        out["decoder.output_projection.weight"] = out.pop("decoder.embed_out")
    if cfg.share_all_embeddings and "decoder.embed_tokens.weight" not in out:
        out["decoder.embed_tokens.weight"] = out["encoder.embed_tokens.weight"]
    if cfg.share_decoder_input_output_embed or cfg.share_all_embeddings:
        out.pop("decoder.output_projection.weight", None)
    return out


def _infer_langs(data_dir: Path) -> tuple[str | None, str | None]:
    """fairseq's infer_language_pair: the first `split.src-tgt.lang.*` file name in data_dir."""
    for f in sorted(p.name for p in data_dir.iterdir()):
        parts = f.split(".")
        if len(parts) >= 3 and len(parts[1].split("-")) == 2:
            a, b = parts[1].split("-")
            return a, b
    return None, None


def _dict_paths(data_dir: Path, task: dict, model: dict, source_lang: str | None,
                target_lang: str | None) -> tuple[Path, Path]:
    if not data_dir.is_dir():
        raise FileNotFoundError(f"fairseq data dir not found: {data_dir}")
    src_lang = source_lang or task.get("source_lang") or model.get("source_lang")
    tgt_lang = target_lang or task.get("target_lang") or model.get("target_lang")
    if not (src_lang and tgt_lang):
        inf_src, inf_tgt = _infer_langs(data_dir)
        src_lang, tgt_lang = src_lang or inf_src, tgt_lang or inf_tgt
    found = []
    for side, lang in (("src", src_lang), ("tgt", tgt_lang)):
        tried = [data_dir / f"dict.{side}.txt"] + ([data_dir / f"dict.{lang}.txt"] if lang else [])
        hit = next((p for p in tried if p.is_file()), None)
        if hit is None:
            raise FileNotFoundError(f"{data_dir}: no {'source' if side == 'src' else 'target'} dictionary "
                                    f"(tried {', '.join(p.name for p in tried)})")
        found.append(hit)
    return found[0], found[1]


def _exported_segmentation(state: dict, checkpoint: Path, bpe: str | None,
                           bpe_model: Path | None) -> tuple[str | None, Path | None]:
    """(bpe, bpe_model) to decode with: those given, else the segmentation recorded by `save_fairseq`
    in a checkpoint it exported (its model file beside the checkpoint), else none (pre-segmented
    text). Raises FileNotFoundError naming the file when the recorded model file is missing."""
    recorded = state.get("aggdec") if isinstance(state.get("aggdec"), dict) else {}
    if bpe is not None or bpe_model is not None or not recorded.get("bpe"):
        return bpe, bpe_model
    path = checkpoint.parent / recorded["bpe_model"]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {checkpoint} was exported with {recorded['bpe']} segmentation by this model "
                                f"file, which is missing; pass --bpe {recorded['bpe']} --bpe-model PATH")
    return recorded["bpe"], path


def _load(checkpoint: Path, data_dir: Path, *, trust: bool, bpe: str | None, bpe_model: Path | None,
          device, dtype, source_lang: str | None,
          target_lang: str | None) -> tuple[Bundle, Path, Path, tuple[str | None, Path | None]]:
    checkpoint, data_dir = Path(checkpoint), Path(data_dir)
    state = _read_pickle(checkpoint, trust)
    bpe, bpe_model = _exported_segmentation(state, checkpoint, bpe, bpe_model)
    args, task = _model_args(state, checkpoint)
    sd = state["model"]
    if not isinstance(sd, dict):
        raise ValueError(f"{checkpoint}: 'model' is not a state dict")
    try:
        cfg = _config_from_args(args, sd, checkpoint)
    except (TypeError, KeyError, AttributeError) as e:  # a field of the wrong type, a malformed state dict
        raise ValueError(f"{checkpoint}: cannot read the model configuration ({type(e).__name__}: {e})") from e
    src_path, tgt_path = _dict_paths(data_dir, task, args, source_lang, target_lang)
    dicts = []
    for path, rows, what in ((src_path, cfg.src_vocab, "encoder.embed_tokens"),
                             (tgt_path, cfg.tgt_vocab, "decoder.embed_tokens")):
        d = Dictionary.load(path)
        if len(d) != rows:
            raise ValueError(f"{path}: the dictionary has {len(d)} entries (4 specials + {len(d) - 4} lines) but the "
                             f"checkpoint's {what} has {rows} rows: wrong dictionary for {checkpoint}")
        dicts.append(d)
    if bpe is not None and bpe_model is None:
        raise ValueError(f"bpe={bpe!r} needs bpe_model (the codes file or sentencepiece model)")
    if bpe_model is not None and not Path(bpe_model).is_file():
        raise FileNotFoundError(f"bpe model not found: {bpe_model}")
    src_tok = DictionaryTokenizer(dicts[0], bpe, bpe_model)
    tgt_tok = DictionaryTokenizer(dicts[1], bpe, bpe_model)
    model = Transformer(cfg)
    weights = _upgrade_state_dict(sd, cfg)
    try:
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()}, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{checkpoint}: weights do not fit the architecture in its config ({e})") from e
    check_vocab(cfg, src_tok, tgt_tok, str(checkpoint))
    model = model.to(device=device, dtype=dtype).eval()
    meta = {"source": "fairseq", "checkpoint": str(checkpoint), "arch": args["arch"]}
    return (Bundle(model=model, src_tok=src_tok, tgt_tok=tgt_tok, path=checkpoint, meta=meta,
                   sha=file_sha(checkpoint)), src_path, tgt_path, (bpe, bpe_model))


def load_fairseq(checkpoint: Path, data_dir: Path, *, trust: bool, bpe: str | None = None,
                 bpe_model: Path | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, source_lang: str | None = None,
                 target_lang: str | None = None) -> Bundle:
    """Load a fairseq `transformer`-family checkpoint and the dictionaries in `data_dir`.

    `trust=True` is required: a .pt file is a pickle. Dictionaries: `dict.src.txt`/`dict.tgt.txt`,
    else `dict.<lang>.txt` with the languages from the arguments, the checkpoint's task config or
    the data dir's file names. `bpe` (None, "subword_nmt", "sentencepiece") with `bpe_model`
    describes how raw text is segmented; without them, a checkpoint written by `save_fairseq` is
    segmented as its source model was (the model file it copied beside it). Errors name the file at
    fault.
    """
    bundle, _, _, _ = _load(checkpoint, data_dir, trust=trust, bpe=bpe, bpe_model=bpe_model, device=device,
                         dtype=dtype, source_lang=source_lang, target_lang=target_lang)
    return bundle


def convert_fairseq(checkpoint: Path, data_dir: Path, out_dir: Path, *, trust: bool, bpe: str | None = None,
                    bpe_model: Path | None = None, dtype: torch.dtype = torch.float32,
                    source_lang: str | None = None, target_lang: str | None = None) -> Path:
    """Write a fairseq checkpoint as a project-format model directory (tokenizer type "dictionary")."""
    bundle, src_path, tgt_path, (bpe, bpe_model) = _load(
        checkpoint, data_dir, trust=trust, bpe=bpe, bpe_model=bpe_model, device="cpu", dtype=torch.float32,
        source_lang=source_lang, target_lang=target_lang)
    files = {"dict.src.txt": src_path, "dict.tgt.txt": tgt_path}
    bpe_name = None
    if bpe_model is not None:
        bpe_name = Path(bpe_model).name
        if bpe_name in files:
            bpe_name = "bpe." + bpe_name
        files[bpe_name] = Path(bpe_model)
    tokenizer = {"type": "dictionary", "src_dict": "dict.src.txt", "tgt_dict": "dict.tgt.txt", "bpe": bpe,
                 "bpe_model": bpe_name}
    meta = dict(bundle.meta, checkpoint=Path(checkpoint).name, checkpoint_sha=bundle.sha)
    return save_project(out_dir, bundle.model, tokenizer, files, dtype=dtype, meta=meta)


# -- writing a fairseq checkpoint ------------------------------------------------------------------


def _symbols(tok: Tokenizer) -> list[str]:
    """The fairseq dictionary symbols of a tokenizer, in id order (specials first)."""
    if isinstance(tok, DictionaryTokenizer):
        return list(tok.dict.symbols)
    if isinstance(tok, SentencePieceTokenizer):
        return SPECIALS + [tok.sp.id_to_piece(i) for i in range(4, len(tok))]
    raise ValueError(f"cannot export a {type(tok).__name__} as a fairseq dictionary")


def _write_dict(symbols: list[str], path: Path) -> None:
    """fairseq dict.txt: one `symbol count` per line after the 4 specials; repeats get the overwrite flag."""
    seen = set(SPECIALS)
    with open(path, "w", encoding="utf-8") as f:
        for s in symbols[4:]:
            if not s or s != s.strip() or "\n" in s:
                raise ValueError(f"symbol {s!r} cannot be written to a fairseq dictionary")
            f.write(f"{s} 1 #fairseq:overwrite\n" if s in seen else f"{s} 1\n")
            seen.add(s)


def _fairseq_args(cfg: ModelConfig, data: str) -> argparse.Namespace:
    a = dict(
        _name="transformer", arch="transformer", task="translation",
        encoder_embed_dim=cfg.d_model, encoder_ffn_embed_dim=cfg.enc_ffn, encoder_layers=cfg.enc_layers,
        encoder_attention_heads=cfg.enc_heads, encoder_normalize_before=cfg.enc_normalize_before,
        encoder_learned_pos=cfg.enc_learned_pos,
        decoder_embed_dim=cfg.d_model, decoder_ffn_embed_dim=cfg.dec_ffn, decoder_layers=cfg.dec_layers,
        decoder_attention_heads=cfg.dec_heads, decoder_normalize_before=cfg.dec_normalize_before,
        decoder_learned_pos=cfg.dec_learned_pos, decoder_input_dim=cfg.d_model, decoder_output_dim=cfg.d_model,
        attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
        activation_fn=cfg.activation, dropout=cfg.dropout,
        share_decoder_input_output_embed=cfg.share_decoder_input_output_embed,  # fairseq implies it from share_all
        share_all_embeddings=cfg.share_all_embeddings, layernorm_embedding=cfg.layernorm_embedding,
        no_scale_embedding=cfg.no_scale_embedding,
        max_source_positions=cfg.max_source_positions, max_target_positions=cfg.max_target_positions,
        # translation task fields (CTranslate2 calls fairseq.tasks.setup_task on this namespace)
        data=data, source_lang="src", target_lang="tgt", load_alignments=False, left_pad_source=True,
        left_pad_target=False, upsample_primary=-1, truncate_source=False, num_batch_buckets=0,
        train_subset="train", dataset_impl=None, required_seq_len_multiple=1, eval_bleu=False,
        pad=cfg.pad, eos=cfg.eos, unk=cfg.unk, bos=cfg.bos, seed=1, cpu=False,
    )
    _base(a)
    return argparse.Namespace(**a)


def _bundle_of(src: Bundle | str | Path) -> Bundle:
    if isinstance(src, Bundle):
        return src
    return load_project(Path(src), dtype=torch.float32)


def save_fairseq(bundle_or_model_dir: Bundle | str | Path, out_dir: str | Path) -> Path:
    """Export a project model as a fairseq checkpoint: out_dir/checkpoint.pt + dict.src.txt + dict.tgt.txt.

    Usage: `fairseq-generate DATA --path out_dir/checkpoint.pt --source-lang src --target-lang tgt`
    (DATA holding these dictionaries). For sentencepiece models the dictionaries list the pieces
    with ids >= 4 in id order, so fairseq ids equal the model's; the sentencepiece model is copied
    too (use `--bpe sentencepiece --sentencepiece-model out_dir/<name>`), and the checkpoint records
    it, so that `load_fairseq` segments raw text with it when no bpe is given.
    """
    bundle = _bundle_of(bundle_or_model_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = bundle.model
    cfg = model.cfg
    for name, fairseq_value in (("first_position", None), ("sinusoidal", "fairseq"), ("output_bias", False),
                                ("activation", ("relu", "gelu")), ("double_token", False), ("relative_buckets", 0),
                                ("norm", "layer"), ("norm_eps", 1e-5), ("gated_ffn", False), ("linear_bias", True),
                                ("head_dim", None), ("attention_scale", True), ("output_scale", 1.0),
                                ("untied_output", False)):
        value = getattr(cfg, name)
        if value != fairseq_value and not (isinstance(fairseq_value, tuple) and value in fairseq_value):
            raise ValueError(f"{bundle.path or '<bundle>'}: model {name}={value!r} has no fairseq `transformer` "
                             "equivalent (an imported Hugging Face or a double-token model); it cannot be exported "
                             "to fairseq")
    if bundle.conventions != Conventions():
        raise ValueError(f"{bundle.path or '<bundle>'}: the model frames its input with special tokens "
                         "(conventions) that fairseq-generate does not apply; it cannot be exported to fairseq")
    check_vocab(cfg, bundle.src_tok, bundle.tgt_tok, str(bundle.path or "<bundle>"))
    _write_dict(_symbols(bundle.src_tok), out / "dict.src.txt")
    _write_dict(_symbols(bundle.tgt_tok), out / "dict.tgt.txt")
    for f in _tokenizer_files(bundle):
        if f.resolve() != (out / f.name).resolve():
            shutil.copyfile(f, out / f.name)

    sd = {k: v.detach().to("cpu", torch.float32).clone() for k, v in model.state_dict().items()}
    if cfg.share_decoder_input_output_embed or cfg.share_all_embeddings:
        sd["decoder.output_projection.weight"] = sd["decoder.embed_tokens.weight"]
    if cfg.share_all_embeddings:
        sd["decoder.embed_tokens.weight"] = sd["encoder.embed_tokens.weight"]
        sd["decoder.output_projection.weight"] = sd["encoder.embed_tokens.weight"]
    # fairseq drops the final layer norm of checkpoints whose version is < 2 (encoder) / <= 2 (decoder).
    sd["encoder.version"] = torch.tensor([3.0])
    sd["decoder.version"] = torch.tensor([3.0])
    args = _fairseq_args(cfg, str(out.resolve()))
    task = {"_name": "translation", "data": str(out.resolve()), "source_lang": "src", "target_lang": "tgt",
            "load_alignments": False, "left_pad_source": True, "left_pad_target": False,
            "max_source_positions": cfg.max_source_positions, "max_target_positions": cfg.max_target_positions,
            "upsample_primary": -1, "truncate_source": False, "num_batch_buckets": 0, "train_subset": "train",
            "dataset_impl": None, "required_seq_len_multiple": 1, "eval_bleu": False}
    state = {
        "args": None,
        "cfg": {"_name": None, "model": args, "task": task},
        "model": sd,
        "criterion": None,
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "FairseqAdam",
                               "lr_scheduler_state": {"best": None}, "num_updates": 0}],
        "task_state": {},
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0}},
        "last_optimizer_state": None,
        "aggdec": {"meta": bundle.meta, "sha": bundle.sha, **_segmentation(bundle)},
    }
    torch.save(state, out / "checkpoint.pt")
    return out


def _segmentation(bundle: Bundle) -> dict[str, str]:
    """{"bpe", "bpe_model" (a file name)} for an exported checkpoint: sentencepiece when both sides
    use the same sentencepiece model, a dictionary model's own bpe; {} for pre-segmented text or two
    different models (fairseq-generate takes one)."""
    src, tgt = bundle.src_tok, bundle.tgt_tok
    if isinstance(src, SentencePieceTokenizer) and isinstance(tgt, SentencePieceTokenizer):
        same = Path(src.path).name == Path(tgt.path).name
        return {"bpe": "sentencepiece", "bpe_model": Path(src.path).name} if same else {}
    if isinstance(src, DictionaryTokenizer) and src.bpe and bundle.path is not None:
        model = _tokenizer_spec(Path(bundle.path)).get("bpe_model")
        return {"bpe": src.bpe, "bpe_model": model} if model else {}
    return {}


def _tokenizer_spec(model_dir: Path) -> dict:
    """The `tokenizer` entry of a project model directory's config.json ({} when unreadable)."""
    try:
        return json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("tokenizer", {})
    except (OSError, json.JSONDecodeError):
        return {}


def _tokenizer_files(bundle: Bundle) -> list[Path]:
    """Segmentation model files of a bundle (sentencepiece models, BPE codes), for copying along."""
    files: list[Path] = []
    for tok in (bundle.src_tok, bundle.tgt_tok):
        if isinstance(tok, SentencePieceTokenizer):
            files.append(Path(tok.path))
    if bundle.path is not None:
        spec = _tokenizer_spec(Path(bundle.path))
        if spec.get("bpe_model"):
            files.append(Path(bundle.path) / spec["bpe_model"])
    unique: dict[str, Path] = {}
    for f in files:
        if f.is_file():
            unique.setdefault(f.name, f)
    return [f for name, f in unique.items() if name not in ("dict.src.txt", "dict.tgt.txt", "checkpoint.pt")]
