"""A verifier with its tokenizers (`Bundle`) and the project's model format as written (`save`); read by
aggdec.checkpoint, which documents the format, and written by the trainers and importers."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_model

from aggdec.conventions import Conventions
from aggdec.model.config import ModelConfig
from aggdec.model.transformer import Transformer
from aggdec.tokenizers import DictionaryTokenizer, Tokenizer

FORMAT = "aggdec-ckpt v1"


@dataclass
class Bundle:
    """A verifier ready to decode: model plus the tokenizers of both sides."""

    model: Transformer
    src_tok: Tokenizer
    tgt_tok: Tokenizer
    path: Path | None = None
    meta: dict = field(default_factory=dict)
    sha: str = ""  # sha256 of the weights file (first 12 hex digits), for signatures and manifests
    conventions: Conventions = field(default_factory=Conventions)  # special-token framing (aggdec.conventions)


def file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def save(out_dir: str | Path, model: Transformer, tokenizer: dict, files: dict[str, Path],
         *, dtype: torch.dtype = torch.float16, meta: dict | None = None, conventions: Conventions | None = None) -> Path:
    """Write `model` (weights cast to `dtype`) and copy tokenizer `files` {name_in_dir: source} into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        if Path(src).resolve() != (out / name).resolve():
            shutil.copyfile(src, out / name)
    clone = Transformer(model.cfg)
    clone.load_state_dict(model.state_dict())
    save_model(clone.to(dtype), str(out / "model.safetensors"))
    config = {"format": FORMAT, "model": model.cfg.to_dict(), "tokenizer": tokenizer, "meta": meta or {}}
    if conventions is not None and conventions != Conventions():
        config["conventions"] = conventions.to_dict()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def vocab_size(tok: Tokenizer) -> int:
    return len(tok.dict) if isinstance(tok, DictionaryTokenizer) else len(tok)


def check_vocab(cfg: ModelConfig, src: Tokenizer, tgt: Tokenizer, where: str, exact: bool = True) -> None:
    """Embedding rows must equal vocabulary sizes; with `exact=False` (imported Hugging Face models,
    whose embeddings are often padded) they must cover them."""
    for side, tok, n in (("source", src, cfg.src_vocab), ("target", tgt, cfg.tgt_vocab)):
        if vocab_size(tok) > n or (exact and vocab_size(tok) != n):
            raise ValueError(f"{where}: {side} vocabulary has {vocab_size(tok)} entries but the model's "
                             f"embedding has {n} rows (mismatched dictionary or tokenizer)")
