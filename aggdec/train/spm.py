"""Train a sentencepiece model with fairseq's special-id layout (bos=0, pad=1, eos=2, unk=3)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path


def train_sentencepiece(texts: Sequence[str], model_prefix: Path, vocab_size: int, *,
                        model_type: str = "unigram", input_sentence_size: int = 1_000_000,
                        character_coverage: float = 0.9999, byte_fallback: bool = True,
                        at_most: bool = False) -> Path:
    """Train on `texts` (one sentence each) and return `<model_prefix>.model`.

    Deterministic: sentences are fed in the given order, no sampling shuffle, one thread.
    At most `input_sentence_size` sentences are used (the first ones). Where the texts hold fewer
    pieces than `vocab_size`: with `at_most`, as many as they hold; else ValueError naming `--vocab-size`.
    """
    import sentencepiece as spm

    model_prefix = Path(model_prefix)
    model_prefix.parent.mkdir(parents=True, exist_ok=True)

    def sentences():
        for i, t in enumerate(texts):
            if i >= input_sentence_size:
                break
            t = t.strip()
            if t:
                yield t

    try:
        _train(spm, sentences(), model_prefix, vocab_size, model_type, input_sentence_size, character_coverage,
               byte_fallback)
    except RuntimeError as e:
        most = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", str(e))
        if most is None:
            raise
        if not at_most:
            raise ValueError(f"--vocab-size {most[1]}: the training text holds at most {most[2]} pieces; "
                             f"pass --vocab-size {most[2]} or less, or more text") from None
        _train(spm, sentences(), model_prefix, int(most[2]), model_type, input_sentence_size, character_coverage,
               byte_fallback)
    return model_prefix.with_suffix(".model")


def _train(spm, sentences, model_prefix: Path, vocab_size: int, model_type: str, input_sentence_size: int,
           character_coverage: float, byte_fallback: bool) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences,
        model_prefix=str(model_prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        byte_fallback=byte_fallback,
        bos_id=0, pad_id=1, eos_id=2, unk_id=3,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=False,
        num_threads=1,
        max_sentence_length=16384,
        minloglevel=2,
    )
