"""Models of published models' shapes with random weights, built on the spot: the names `--model` of
`compare` and `roofline` takes besides model directories (nothing downloaded, nothing kept in git).

`SHAPES` maps each name to its transformers config (the published model's dimensions) and its builder,
which saves the model with `save_pretrained` and a tokenizer of the model's kind trained on the
benchmark's sources (the first `TEXTS` of `--data`'s column, up to `PIECES` sentencepiece pieces); the
weights are seeded, so the same name and sources give the same model.

- opus-mt-shaped: Marian, opus-mt-en-de's shape (6+6 layers, d_model 512, 8 heads, FFN 2048, swish,
  58,101 tokens: vocab.json padded with unused tokens), init std 0.1: every output runs to the limit.
- t5-base-shaped: T5 v1.0 base (12+12 layers, d_model 768, 12 heads of d_kv 64, FFN 3072, ReLU, 32,128
  embedding rows tied to the output, about 223M parameters); T5's tokenizer and weights as
  models/make_t5.py makes them.
- m2m100-shaped: M2M100-418M (12+12 layers, d_model 1024, 16 heads, FFN 4096, ReLU, scaled embeddings,
  128,112 rows tied to the output, about 484M parameters, which the name counts without the
  embedding's 131M); M2M100Tokenizer's files, vocab.json padded with unused tokens to the real model's
  128,004 entries, so that its 100 language tokens and 8 "madeup words" have their real ids; the
  source is __en__ text </s>, the output starts with __de__ (forced: `generation_config`'s
  forced_bos_token_id for transformers, aggdec's conventions, CTranslate2's target prefix).

The T5 and M2M100 shapes write text pieces only (`text_pieces_only`): the embedding row of every other
token is zero, so its logit under the tied output projection is 0, below the largest of thousands of
random logits. Their outputs thus run to `--max-new` (eos is never written) and are comparable between
systems: no pad (aggdec never writes it, the peers would) and no row CTranslate2's vocabulary names
otherwise than the tokenizer (T5's rows past the tokenizer, M2M100's madeup words).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

TEXTS = 5000  # sources a shape's tokenizer is trained on
PIECES = 8000  # sentencepiece pieces at most (fewer where the sources have not that many)
OPUS_MT = dict(vocab_size=58101, decoder_vocab_size=58101, d_model=512, encoder_layers=6, decoder_layers=6,
               encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
               max_position_embeddings=512, activation_function="swish", scale_embedding=True, pad_token_id=58100,
               eos_token_id=0, decoder_start_token_id=58100, forced_eos_token_id=0)
T5_BASE = dict(vocab_size=32128, d_model=768, d_kv=64, num_heads=12, num_layers=12, num_decoder_layers=12, d_ff=3072,
               feed_forward_proj="relu", tie_word_embeddings=True)
M2M100_418M = dict(vocab_size=128112, d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                   decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, activation_function="relu",
                   scale_embedding=True, max_position_embeddings=1024, bos_token_id=0, pad_token_id=1, eos_token_id=2,
                   decoder_start_token_id=2, tie_word_embeddings=True)
M2M100_ENTRIES = 128004  # vocab.json's entries in M2M100-418M; the language tokens and madeup words follow
M2M100_LANGS = ("en", "de")  # source, target


class Shape(NamedTuple):
    config: Callable[[], PretrainedConfig]  # -> the shape's transformers config
    build: Callable[[PretrainedConfig, Path, list[str]], None]  # (config, folder, texts): model and tokenizer saved


def train_spm(texts: list[str], prefix: Path, **special_ids: int) -> Path:
    """A unigram sentencepiece model of up to PIECES pieces trained on `texts` -> prefix.model (and .vocab)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=PIECES,
                                   hard_vocab_limit=False, model_type="unigram", character_coverage=1.0,
                                   minloglevel=2, num_threads=2, **special_ids)
    return prefix.with_suffix(".model")


def padded(vocab: dict[str, int], size: int) -> dict[str, int]:
    """`vocab` (ids 0 .. len - 1) with unused tokens <unusedI> at ids len .. size - 1."""
    return {**vocab, **{f"<unused{i}>": i for i in range(len(vocab), size)}}


def text_pieces_only(embedding: torch.Tensor, pieces: range) -> None:
    """Zero every row of a tied `embedding` outside `pieces`: those tokens' logits are 0, never the
    largest (module docstring)."""
    import torch

    with torch.no_grad():
        embedding[: pieces.start] = 0.0
        embedding[pieces.stop:] = 0.0


def marian_config() -> PretrainedConfig:
    from transformers import MarianConfig

    return MarianConfig(**OPUS_MT, init_std=0.1)


def build_marian(cfg: PretrainedConfig, out: Path, texts: list[str]) -> None:
    """OPUS-MT's files: source.spm = target.spm, vocab.json (</s> 0, <unk> 1, the pieces, unused tokens,
    <pad> last)."""
    import sentencepiece as spm
    import torch
    from transformers import MarianMTModel, MarianTokenizer

    model_file = train_spm(texts, out / "spm")
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    pieces = [p for p in (sp.id_to_piece(i) for i in range(sp.get_piece_size())) if p not in ("<unk>", "<s>", "</s>")]
    vocab = padded({"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}, cfg.vocab_size - 1)
    vocab["<pad>"] = cfg.vocab_size - 1
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes(model_file.read_bytes())
    (out / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    torch.manual_seed(0)
    MarianMTModel(cfg).save_pretrained(out)
    MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json")).save_pretrained(out)


def t5_config() -> PretrainedConfig:
    from models.make_t5 import config

    return config(T5_BASE)


def build_t5(cfg: PretrainedConfig, out: Path, texts: list[str]) -> None:
    """T5's tokenizer (models/make_t5.py: pad 0, </s> 1, <unk> 2, the pieces, 100 sentinels) and weights."""
    from models.make_t5 import EXTRA_IDS, random_t5, tokenizer

    tok = tokenizer(texts, out, PIECES)
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"the tokenizer has {len(tok)} entries, more than the model's {cfg.vocab_size} rows")
    model = random_t5(cfg, seed=0, tied=T5_BASE["tie_word_embeddings"])
    text_pieces_only(model.shared.weight, range(3, len(tok) - EXTRA_IDS))
    model.save_pretrained(out)


def m2m100_config() -> PretrainedConfig:
    from transformers import M2M100Config

    return M2M100Config(**M2M100_418M, init_std=0.1)


def build_m2m100(cfg: PretrainedConfig, out: Path, texts: list[str]) -> None:
    """M2M100Tokenizer's files: sentencepiece.bpe.model and vocab.json (<s> 0, <pad> 1, </s> 2, <unk> 3,
    the pieces, unused tokens to M2M100_ENTRIES), English to German."""
    import sentencepiece as spm
    import torch
    from transformers import M2M100ForConditionalGeneration, M2M100Tokenizer
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

    model_file = train_spm(texts, out / "spm", bos_id=0, pad_id=1, eos_id=2, unk_id=3)
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    vocab = padded({sp.id_to_piece(i): i for i in range(sp.get_piece_size())}, M2M100_ENTRIES)
    model_file.rename(out / "sentencepiece.bpe.model")
    (out / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    source, target = M2M100_LANGS
    # the language tokens listed as special tokens, as the hub's files list them: otherwise transformers 5's
    # M2M100Tokenizer leaves them out of get_vocab(), whence CTranslate2's converter takes the vocabulary
    languages = [f"__{code}__" for code in FAIRSEQ_LANGUAGE_CODES["m2m100"]]
    tok = M2M100Tokenizer(str(out / "vocab.json"), str(out / "sentencepiece.bpe.model"), src_lang=source,
                          tgt_lang=target, additional_special_tokens=languages)
    rows = len(tok.encoder) + len(tok.lang_token_to_id) + tok.num_madeup_words
    if rows != cfg.vocab_size:
        raise ValueError(f"the tokenizer has {rows} entries, the model {cfg.vocab_size} rows")
    torch.manual_seed(0)
    model = M2M100ForConditionalGeneration(cfg)
    text_pieces_only(model.model.shared.weight, range(4, sp.get_piece_size()))
    model.generation_config.forced_bos_token_id = tok.get_lang_id(target)
    model.save_pretrained(out)
    tok.save_pretrained(out)


SHAPES = {"opus-mt-shaped": Shape(marian_config, build_marian), "t5-base-shaped": Shape(t5_config, build_t5),
          "m2m100-shaped": Shape(m2m100_config, build_m2m100)}


def build(name: str, texts: list[str], work: Path) -> Path:
    """Shape `name`'s directory with a tokenizer trained on `texts`: work/NAME-LEN(TEXTS), built unless it
    is there (built beside it and renamed, so that a directory there is whole)."""
    out = work / f"{name}-{len(texts)}"
    if not out.is_dir():
        part = work / f"{out.name}.part"
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        shape = SHAPES[name]
        shape.build(shape.config(), part, texts)
        part.rename(out)
    return out


def resolve(model: str, data: Path, column: str, work: Path) -> Path:
    """`model` as a model directory: a shape's name is built under `work` (`build`, on the first TEXTS
    sources of `data`'s `column`); anything else is a path."""
    if model not in SHAPES:
        return Path(model)
    from aggdec.train.ar import read_tsv

    return build(model, read_tsv(data, column, column)[0][:TEXTS], work)
