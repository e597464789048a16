"""Tokenizers of imported Hugging Face models, read from the model directory without `transformers`.

Three kinds, named in config.json's tokenizer entry:
- "hf-pieces": sentencepiece pieces looked up in a vocab.json (Marian/OPUS-MT: source.spm,
  target.spm; M2M100: sentencepiece.bpe.model). Ids the vocabulary lacks are unk; a leading
  ">>xx<<" language code (multilingual OPUS-MT) is one token, as MarianTokenizer does.
- "hf-tokenizers": a serialized `tokenizers` pipeline, tokenizer.json (BART's byte-level BPE, mBART,
  NLLB, T5), run by the `tokenizers` library.
- "hf-spiece": T5's spiece.model, whose piece ids are the model's, and `extra_ids` sentinel tokens
  <extra_id_i> above them (a T5 directory without tokenizer.json).

`encode` returns the text's ids without special tokens (aggdec.conventions adds them); `decode`
drops special ids and detokenizes like `tokenizer.decode(ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

HF_TOKENIZERS = ("hf-pieces", "hf-tokenizers", "hf-spiece")


def clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (applied when tokenizer_config says
    clean_up_tokenization_spaces)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class PieceVocabTokenizer:
    """sentencepiece segmentation + vocab.json ids (Marian, M2M100)."""

    def __init__(self, spm_file: str | Path, vocab: dict[str, int], unk: int, specials: set[int],
                 decode_spm_file: str | Path | None = None, cleanup: bool = False):
        import sentencepiece as spm

        for f in (spm_file, decode_spm_file):
            if f is not None and not Path(f).is_file():
                raise FileNotFoundError(f"sentencepiece model not found: {f}")
        self.sp = spm.SentencePieceProcessor(model_file=str(spm_file))
        self.decode_sp = self.sp if decode_spm_file is None else spm.SentencePieceProcessor(model_file=str(decode_spm_file))
        self.vocab, self.unk, self.specials, self.cleanup = vocab, unk, specials, cleanup
        self.pieces = {i: p for p, i in vocab.items()}

    def __len__(self) -> int:
        return max(self.vocab.values()) + 1

    def encode(self, text: str) -> list[int]:
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1 and text[: end + 2] in self.vocab:
            code, text = [self.vocab[text[: end + 2]]], text[end + 2:]
        return code + [self.vocab.get(p, self.unk) for p in self.sp.encode(text, out_type=str)]

    def decode(self, ids: list[int]) -> str:
        pieces = [self.pieces[i] for i in ids if i not in self.specials and i in self.pieces]
        text = self.decode_sp.decode_pieces(pieces).replace("\u2581", " ").strip()
        return clean_up_tokenization(text) if self.cleanup else text

    def unrepresented(self, ids: list[int]) -> float:
        """The share of `ids` that are the unknown token."""
        return sum(1 for i in ids if i == self.unk) / max(1, len(ids))


class TokenizersTokenizer:
    """A `tokenizers` pipeline from tokenizer.json (BART byte-level BPE, mBART, NLLB)."""

    def __init__(self, file: str | Path, unk: int | None, cleanup: bool = False):
        from tokenizers import Tokenizer as HFTokenizer

        if not Path(file).is_file():
            raise FileNotFoundError(f"tokenizer file not found: {file}")
        try:
            self.tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise ValueError(f"{file}: not a readable tokenizers file ({str(e).splitlines()[0][:120]})") from e
        self.unk, self.cleanup = unk, cleanup

    def __len__(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        text = self.tok.decode(ids, skip_special_tokens=True)
        return clean_up_tokenization(text) if self.cleanup else text

    def unrepresented(self, ids: list[int]) -> float:
        """The share of `ids` that are the unknown token (byte-level BPE has none)."""
        return 0.0 if self.unk is None else sum(1 for i in ids if i == self.unk) / max(1, len(ids))


class T5PieceTokenizer:
    """T5's sentencepiece model with its sentinels, as transformers' T5Tokenizer: <extra_id_i> is id
    pieces + extra_ids - 1 - i; sentinels and the special pieces written out in the text (</s>,
    <pad>, <unk>) are single tokens, the text between them is segmented piece by piece; decoding
    drops them all, and ids past the vocabulary (a T5's embedding has rows to a multiple of 128)."""

    def __init__(self, file: str | Path, extra_ids: int, cleanup: bool = False):
        import sentencepiece as spm

        if not Path(file).is_file():
            raise FileNotFoundError(f"sentencepiece model not found: {file}")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(file))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{file}: not a readable sentencepiece model ({str(e).splitlines()[0][:120]})") from e
        n = self.sp.get_piece_size()
        self.special = {f"<extra_id_{i}>": n + extra_ids - 1 - i for i in range(extra_ids)}
        for i in (self.sp.pad_id(), self.sp.eos_id(), self.sp.unk_id()):
            if i >= 0:
                self.special[self.sp.id_to_piece(i)] = i
        self.split = re.compile("(" + "|".join(re.escape(t) for t in self.special) + ")")
        self.skip, self.cleanup, self.pieces, self.size = set(self.special.values()), cleanup, n, n + extra_ids

    def __len__(self) -> int:
        return self.size

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self.split.split(text):
            if part in self.special:
                ids.append(self.special[part])
            elif part.strip():
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: list[int]) -> str:
        text = self.sp.decode([i for i in ids if i not in self.skip and i < self.pieces])
        return clean_up_tokenization(text) if self.cleanup else text

    def unrepresented(self, ids: list[int]) -> float:
        """The share of `ids` that are the unknown token."""
        return sum(1 for i in ids if i == self.sp.unk_id()) / max(1, len(ids))


def _vocab(path: Path) -> dict[str, int]:
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable vocabulary ({e})") from e
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise ValueError(f"{path}: must map tokens to ids")
    return vocab


def hf_tokenizers(d: Path, spec: dict) -> tuple:
    """(source, target) tokenizers of an imported model directory `d` from its tokenizer entry."""
    specials = set(spec.get("specials", []))
    cleanup = bool(spec.get("cleanup", False))
    if spec["type"] == "hf-pieces":
        src_vocab = _vocab(d / spec["src_vocab"])
        tgt_vocab = src_vocab if spec["tgt_vocab"] == spec["src_vocab"] else _vocab(d / spec["tgt_vocab"])
        for vocab in {id(v): v for v in (src_vocab, tgt_vocab)}.values():
            vocab.update(spec.get("added", {}))  # language tokens beyond vocab.json (M2M100)
        src = PieceVocabTokenizer(d / spec["src_spm"], src_vocab, spec["unk"], specials, cleanup=cleanup)
        tgt = PieceVocabTokenizer(d / spec["tgt_spm"], tgt_vocab, spec["unk"], specials,
                                  decode_spm_file=d / spec.get("decode_spm", spec["tgt_spm"]), cleanup=cleanup)
        return src, tgt
    if spec["type"] == "hf-spiece":
        tok = T5PieceTokenizer(d / spec["file"], spec["extra_ids"], cleanup)
        return tok, tok
    tok = TokenizersTokenizer(d / spec["file"], spec.get("unk"), cleanup)
    return tok, tok
