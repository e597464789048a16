"""The project's model format: a directory with config.json, model.safetensors and tokenizer files.

config.json = {"format": "aggdec-ckpt v1", "model": ModelConfig fields, "tokenizer": {...},
"meta": {...}}. The tokenizer entry is either
  {"type": "sentencepiece", "src": "spm.model", "tgt": "spm.model"}   (project models), or
  {"type": "dictionary", "src_dict": "dict.src.txt", "tgt_dict": "dict.tgt.txt",
   "bpe": null | "subword_nmt" | "sentencepiece", "bpe_model": "<file>" | null}  (converted fairseq), or
  {"type": "hf-pieces" | "hf-tokenizers", ...}  (imported Hugging Face models, aggdec.tokenizers.hf).
An optional "conventions" entry gives the model's special-token framing (aggdec.conventions).
Weights load without pickle. Files are named relative to the directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from aggdec.bundle import FORMAT, Bundle, check_vocab, file_sha
from aggdec.conventions import Conventions
from aggdec.model.config import ModelConfig
from aggdec.model.draft_head import DraftHead, DraftHeadConfig
from aggdec.model.heads import ProposalHeads
from aggdec.model.transformer import Transformer
from aggdec.tokenizers import DictionaryTokenizer, SentencePieceTokenizer, Tokenizer
from aggdec.tokenizers.dictionary import Dictionary
from aggdec.tokenizers.hf import HF_TOKENIZERS, hf_tokenizers

HEADS_FORMAT = "aggdec-heads v1"
DRAFT_HEAD_FORMAT = "aggdec-draft-head v1"


def _tokenizers(d: Path, spec: dict) -> tuple[Tokenizer, Tokenizer]:
    kind = spec.get("type")
    if kind == "sentencepiece":
        src = SentencePieceTokenizer(d / spec["src"])
        tgt = src if spec["tgt"] == spec["src"] else SentencePieceTokenizer(d / spec["tgt"])
        return src, tgt
    if kind == "dictionary":
        bpe_model = d / spec["bpe_model"] if spec.get("bpe_model") else None
        src = DictionaryTokenizer(Dictionary.load(d / spec["src_dict"]), spec.get("bpe"), bpe_model)
        tgt = DictionaryTokenizer(Dictionary.load(d / spec["tgt_dict"]), spec.get("bpe"), bpe_model)
        return src, tgt
    if kind in HF_TOKENIZERS:
        return hf_tokenizers(d, spec)
    raise ValueError(f"{d / 'config.json'}: tokenizer.type must be one of sentencepiece, dictionary, "
                     f"{', '.join(HF_TOKENIZERS)}; got {kind!r}")


def load(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
         trust: bool = False) -> Bundle:
    """Load a project-format model directory, or a Hugging Face model directory (imported in memory,
    aggdec.hf_import; its pickled pytorch_model.bin is read only with `trust`). Errors name the file at
    fault."""
    d = Path(path)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{d}: not a model directory (no config.json)")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: invalid JSON ({e})") from e
    if isinstance(config, dict) and "format" not in config and "model_type" in config:
        from aggdec import hf_import

        return hf_import.load(d, device=device, dtype=dtype, trust=trust)
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        got = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"{cfg_path}: format is {got!r}, expected {FORMAT!r}")
    for key, kind in (("model", dict), ("tokenizer", dict)):
        if not isinstance(config.get(key), kind):
            raise ValueError(f"{cfg_path}: {key}: missing or not an object")
    try:
        cfg = ModelConfig.from_dict(config["model"])
    except ValueError as e:
        raise ValueError(f"{cfg_path}: model.{e}") from e
    try:
        src_tok, tgt_tok = _tokenizers(d, config["tokenizer"])
    except KeyError as e:
        raise ValueError(f"{cfg_path}: tokenizer.{e.args[0]}: missing") from e
    meta = config.get("meta", {})
    check_vocab(cfg, src_tok, tgt_tok, str(d), exact=config["tokenizer"].get("type") not in HF_TOKENIZERS)
    weights = d / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: missing")
    model = Transformer(cfg)
    try:
        missing, unexpected = load_model(model, str(weights), strict=False)
    except Exception as e:  # safetensors raises several types for truncated/corrupt files
        raise ValueError(f"{weights}: cannot read weights ({e})") from e
    if missing or unexpected:
        raise ValueError(f"{weights}: weights do not match config.json (missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]})")
    conventions = Conventions.from_dict(config.get("conventions", {}), str(cfg_path))
    model = model.to(device=device, dtype=dtype).eval()
    return Bundle(model=model, src_tok=src_tok, tgt_tok=tgt_tok, path=d, meta=meta, sha=file_sha(weights),
                  conventions=conventions)


def save_heads(out: Path, heads: ProposalHeads, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_model(heads.half(), str(out / "heads.safetensors"))
    cfg = {"format": HEADS_FORMAT, "d_model": heads.fc1.shape[1], "num_heads": heads.num_heads,
           "hidden": heads.fc1.shape[2], "meta": meta}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_heads(path: str | Path, verifier_sha: str | None = None) -> ProposalHeads:
    """Load blockwise proposal heads (no pickle); the verifier hash must match when given."""
    d = Path(path)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{d}: not a proposal-heads directory (no config.json)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("format") != HEADS_FORMAT:
        raise ValueError(f"{cfg_path}: format is {cfg.get('format')!r}, expected {HEADS_FORMAT!r}")
    want = cfg.get("meta", {}).get("verifier_sha")
    if verifier_sha and want and want != verifier_sha:
        raise ValueError(f"{d}: heads were trained for verifier {want}, not {verifier_sha}")
    heads = ProposalHeads(cfg["d_model"], cfg["num_heads"], cfg["hidden"])
    load_model(heads, str(d / "heads.safetensors"))
    return heads.float().eval()


def load_drafter(path: str | Path, verifier: Bundle, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> ProposalHeads | DraftHead:
    """A drafter directory for `verifier`: proposal heads (heads.safetensors) or a GAD draft head
    (draft_head.safetensors). Raises FileNotFoundError for a missing directory, ValueError when it is
    neither or was not made for this verifier."""
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path}: no such drafter directory")
    if (Path(path) / "heads.safetensors").is_file():
        return load_heads(path, verifier.sha).to(device=device, dtype=dtype)
    if (Path(path) / "draft_head.safetensors").is_file():
        return load_draft_head(path, verifier.sha).to(device=device, dtype=dtype)
    raise ValueError(f"{path}: not a drafter directory (no heads.safetensors or draft_head.safetensors)")


def save_draft_head(out: str | Path, head: DraftHead, meta: dict) -> Path:
    """Write a GAD draft head directory: config.json + draft_head.safetensors (fp32)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_model(head, str(out / "draft_head.safetensors"))
    config = {"format": DRAFT_HEAD_FORMAT, "head": head.cfg.to_dict(), "meta": meta}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def load_draft_head(path: str | Path, verifier_sha: str | None = None) -> DraftHead:
    """A draft head directory (no pickle); raises ValueError if it belongs to another verifier."""
    d = Path(path)
    config = json.loads((d / "config.json").read_text(encoding="utf-8"))
    if config.get("format") != DRAFT_HEAD_FORMAT:
        raise ValueError(f"{d / 'config.json'}: format is {config.get('format')!r}, expected {DRAFT_HEAD_FORMAT!r}")
    want = config.get("meta", {}).get("verifier_sha")
    if verifier_sha and want and want != verifier_sha:
        raise ValueError(f"{d}: draft head was trained for verifier {want}, not {verifier_sha}")
    head = DraftHead(DraftHeadConfig(**config["head"]))
    load_model(head, str(d / "draft_head.safetensors"))
    return head.eval()
