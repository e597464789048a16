"""Text <-> token ids for one side of a model.

`Tokenizer.encode(text)` returns ids without the final eos; `decode(ids)` returns text. Two kinds:
- `SentencePieceTokenizer`: the project's own models; sentencepiece ids are model ids (the model is
  trained with bos=0, pad=1, eos=2, unk=3, fairseq's layout).
- `DictionaryTokenizer`: fairseq checkpoints; a fairseq `dict.*.txt` plus a segmentation: none
  (input already tokenized, split on whitespace), subword-nmt BPE (`@@ ` joiners, codes file) or a
  sentencepiece model producing pieces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from aggdec.tokenizers.dictionary import UNK, Dictionary


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def unrepresented(self, ids: list[int]) -> float: ...


class SentencePieceTokenizer:
    def __init__(self, model_file: str | Path):
        import sentencepiece as spm

        path = Path(model_file)
        if not path.is_file():
            raise FileNotFoundError(f"sentencepiece model not found: {path}")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{path}: not a readable sentencepiece model ({str(e).splitlines()[0][:120]})") from e
        self.path = path
        want = {"bos": 0, "pad": 1, "eos": 2, "unk": 3}
        got = {"bos": self.sp.bos_id(), "pad": self.sp.pad_id(), "eos": self.sp.eos_id(), "unk": self.sp.unk_id()}
        if got != want:
            raise ValueError(f"{path}: special ids {got} differ from fairseq's layout {want}; "
                             "train it with --bos_id=0 --pad_id=1 --eos_id=2 --unk_id=3")

    def __len__(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def unrepresented(self, ids: list[int]) -> float:
        """The share of `ids` (bare word-boundary pieces aside) that stand for text the vocabulary
        lacks: unknown tokens and byte fallbacks."""
        words = [i for i in ids if self.sp.id_to_piece(i) != "\u2581"]
        return sum(1 for i in words if self.sp.is_unknown(i) or self.sp.is_byte(i)) / max(1, len(words))


class DictionaryTokenizer:
    """fairseq dictionary lookup after a segmentation step (`bpe` is None, "subword_nmt" or "sentencepiece")."""

    def __init__(self, dictionary: Dictionary, bpe: str | None = None, bpe_model: str | Path | None = None):
        self.dict = dictionary
        self.bpe = bpe
        if bpe is None:
            self._split, self._join = str.split, " ".join
        elif bpe == "subword_nmt":
            if bpe_model is None:
                raise ValueError("subword_nmt BPE needs a codes file")
            from subword_nmt.apply_bpe import BPE

            with open(bpe_model, encoding="utf-8") as f:
                self._bpe = BPE(f)
            self._split = lambda text: self._bpe.process_line(text).split()
            self._join = lambda pieces: " ".join(pieces).replace("@@ ", "").removesuffix("@@")
        elif bpe == "sentencepiece":
            if bpe_model is None:
                raise ValueError("sentencepiece segmentation needs a model file")
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_file=str(bpe_model))
            self._split = lambda text: self._sp.encode(text, out_type=str)
            self._join = lambda pieces: self._sp.decode_pieces(pieces)
        else:
            raise ValueError(f"unknown bpe {bpe!r}: use none, subword_nmt or sentencepiece")

    def encode(self, text: str) -> list[int]:
        return [self.dict.index(p) for p in self._split(text)]

    def unrepresented(self, ids: list[int]) -> float:
        """The share of `ids` that are the dictionary's unknown symbol."""
        return sum(1 for i in ids if i == UNK) / max(1, len(ids))

    def decode(self, ids: list[int]) -> str:
        return self._join(self.dict.symbols_of(ids))
