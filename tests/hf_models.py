"""Tiny Hugging Face encoder-decoders built in the test session (no download): a family's config with
small dimensions, tokenizers trained on synthetic sentences, weights trained for a few seconds on a
copy task so that outputs are neither constant nor flat, saved with `save_pretrained`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from conftest import synthetic_sentences

SMALL = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
             encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128, dropout=0.0,
             attention_dropout=0.0, activation_dropout=0.0)
M2M_LANGS = ("en", "de", "fr")


def _spm(out: Path, texts: list[str], vocab: int, **kw) -> Path:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(out / "spm"), vocab_size=vocab, model_type="unigram",
        character_coverage=1.0, shuffle_input_sentence=False, hard_vocab_limit=False, num_threads=1, minloglevel=2,
        **kw)
    return out / "spm.model"


def _train(model, pairs: list[tuple[list[int], list[int]]], pad: int, steps: int, seed: int) -> None:
    """Teacher-forced training on (source ids, label ids) pairs; labels include the final eos."""
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = rng.sample(pairs, 32)
        ws, wt = max(len(s) for s, _ in batch), max(len(t) for _, t in batch)
        src = torch.full((32, ws), pad)
        labels = torch.full((32, wt), -100)
        for b, (s, t) in enumerate(batch):
            src[b, :len(s)] = torch.tensor(s)
            labels[b, :len(t)] = torch.tensor(t)
        loss = model(input_ids=src, attention_mask=src.ne(pad), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build_marian(out: Path, steps: int = 200, seed: int = 0, separate: bool = False) -> Path:
    """OPUS-MT layout: source.spm/target.spm + vocab.json (</s>=0, <unk>=1, pad last), swish, scaled
    embeddings, Marian's sinusoidal positions, a non-zero final_logits_bias. `separate`: target ids
    from their own target_vocab.json (another order) and separate encoder and decoder embeddings."""
    import sentencepiece as spm
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    out.mkdir(parents=True, exist_ok=True)
    texts = synthetic_sentences(400, seed)
    model_file = _spm(out, texts, 120)
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.id_to_piece(i) not in ("<unk>", "<s>", "</s>")]
    vocabs = {"vocab.json": pieces, **({"target_vocab.json": pieces[::-1]} if separate else {})}
    for name, order in vocabs.items():
        vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(order)}}
        vocab["<pad>"] = len(vocab)
        (out / name).write_text(json.dumps(vocab), encoding="utf-8")
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes(model_file.read_bytes())
    tok = MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json"),
                          target_vocab_file=str(out / "target_vocab.json") if separate else None, separate_vocabs=separate)
    torch.manual_seed(seed)
    n = len(pieces) + 3
    cfg = MarianConfig(vocab_size=n, decoder_vocab_size=n, pad_token_id=n - 1, eos_token_id=0, decoder_start_token_id=n - 1,
                       activation_function="swish", scale_embedding=True, share_encoder_decoder_embeddings=not separate,
                       **SMALL)
    model = MarianMTModel(cfg)
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 0.5)
    pairs = [(tok(t).input_ids, tok(text_target=t).input_ids) for t in texts]
    _train(model, pairs, cfg.pad_token_id, steps, seed)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_bart(out: Path, steps: int = 200, seed: int = 0) -> Path:
    """BART layout: byte-level BPE (tokenizers), <s> text </s>, learned positions with offset 2,
    layernorm_embedding, post-norm, GELU, forced bos."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import BartConfig, BartForConditionalGeneration, BartTokenizer

    out.mkdir(parents=True, exist_ok=True)
    texts = synthetic_sentences(400, seed)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                            show_progress=False)
    bpe.save_model(str(out))
    tok = BartTokenizer.from_pretrained(str(out))  # from vocab.json + merges.txt
    torch.manual_seed(seed)
    cfg = BartConfig(vocab_size=len(tok), forced_bos_token_id=0, **SMALL)
    model = BartForConditionalGeneration(cfg)
    pairs = [(ids, ids) for ids in (tok(t).input_ids for t in texts)]
    _train(model, pairs, cfg.pad_token_id, steps, seed)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_m2m100(out: Path, steps: int = 200, seed: int = 0) -> Path:
    """M2M100 layout: sentencepiece + vocab.json with language tokens after it, __en__ text </s>,
    fairseq sinusoidal positions, pre-norm, ReLU, target language forced first."""
    from transformers import (
        M2M100Config,
        M2M100ForConditionalGeneration,
        M2M100Tokenizer,
    )

    out.mkdir(parents=True, exist_ok=True)
    texts = synthetic_sentences(400, seed)
    model_file = _spm(out, texts, 120, bos_id=0, pad_id=1, eos_id=2, unk_id=3)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    vocab.update({"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3})
    (out / "sentencepiece.bpe.model").write_bytes(model_file.read_bytes())
    (out / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tok = M2M100Tokenizer(str(out / "vocab.json"), str(out / "sentencepiece.bpe.model"), src_lang="en", tgt_lang="de",
                          language_codes="m2m100")
    torch.manual_seed(seed)  # rows: the vocabulary, M2M100's 100 language tokens and its 8 "madeup words"
    cfg = M2M100Config(vocab_size=len(tok.encoder) + len(tok.lang_token_to_id) + 8, **SMALL)
    model = M2M100ForConditionalGeneration(cfg)
    pairs = []
    for i, t in enumerate(texts):
        tok.src_lang, tok.tgt_lang = "en", M2M_LANGS[i % len(M2M_LANGS)]
        pairs.append((tok(t).input_ids, tok(text_target=t).input_ids))
    _train(model, pairs, cfg.pad_token_id, steps, seed)
    tok.src_lang, tok.tgt_lang = "en", "de"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _pipeline(out: Path, bpe, langs: tuple[str, ...], seed: int, **config) -> tuple[list[str], object, dict[str, int]]:
    """Train the `tokenizers` model `bpe` on synthetic sentences with fairseq's four special tokens,
    add the language codes `langs` as special tokens and save tokenizer.json plus a
    tokenizer_config.json with `config` and src_lang = langs[0]. -> (texts, bpe, {code: id})."""
    out.mkdir(parents=True, exist_ok=True)
    texts = synthetic_sentences(400, seed)
    bpe.train_from_iterator(texts, vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], show_progress=False)
    bpe.add_special_tokens(list(langs))
    bpe.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "src_lang": langs[0]}), encoding="utf-8")
    return texts, bpe, {code: bpe.token_to_id(code) for code in langs}


MBART_LANGS = ("en_XX", "de_DE")


def build_mbart(out: Path, steps: int = 200, seed: int = 0, fifty: bool = False) -> Path:
    """mBART(-cc25) layout: text </s> en_XX on the source, the decoder starts from the target
    language token; learned positions with offset 2, layernorm_embedding, pre-norm with final layer
    norms, scaled embeddings, GELU. The tokenizer is a `tokenizers` pipeline in tokenizer.json with
    the language codes as special tokens (the layout of MBartTokenizer's saved files). `fifty`:
    mBART-50's framing instead, en_XX text </s>, the decoder starting from </s> with the target
    language forced first."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import MBartConfig, MBartForConditionalGeneration

    texts, bpe, lang = _pipeline(out, ByteLevelBPETokenizer(), MBART_LANGS, seed,
                                 tokenizer_class="MBart50Tokenizer" if fifty else "MBartTokenizer", tgt_lang="de_DE")
    torch.manual_seed(seed)
    cfg = MBartConfig(vocab_size=bpe.get_vocab_size(), scale_embedding=True,
                      decoder_start_token_id=2 if fifty else lang["de_DE"], **SMALL)
    model = MBartForConditionalGeneration(cfg)
    if fifty:  # labels de_DE text </s>, fed after the decoder start </s>
        pairs = [([lang["en_XX"], *ids, 2], [lang["de_DE"], *ids, 2]) for ids in (bpe.encode(t).ids for t in texts)]
    else:  # labels text </s> de_DE, shifted right by wrapping de_DE to the front (MBart's shift_tokens_right)
        pairs = [(ids + [2, lang["en_XX"]], ids + [2, lang["de_DE"]]) for ids in (bpe.encode(t).ids for t in texts)]
    _train(model, pairs, cfg.pad_token_id, steps, seed)
    model.save_pretrained(out)
    return out


NLLB_LANGS = ("eng_Latn", "deu_Latn", "fra_Latn")


def build_nllb(out: Path, steps: int = 200, seed: int = 0) -> Path:
    """NLLB layout: the M2M100 architecture with a sentencepiece-BPE `tokenizers` pipeline in
    tokenizer.json whose language codes (eng_Latn, ...) are special tokens; eng_Latn text </s>, the
    target language forced first."""
    from tokenizers import SentencePieceBPETokenizer
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    texts, bpe, lang = _pipeline(out, SentencePieceBPETokenizer(), NLLB_LANGS, seed, tokenizer_class="NllbTokenizer",
                                 tgt_lang="deu_Latn")
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(M2M100Config(vocab_size=bpe.get_vocab_size(), **SMALL))
    pairs = [([lang["eng_Latn"], *ids, 2], [lang[NLLB_LANGS[i % 3]], *ids, 2])
             for i, ids in enumerate(bpe.encode(t).ids for t in texts)]
    _train(model, pairs, model.config.pad_token_id, steps, seed)
    model.save_pretrained(out)
    return out


TASK_PREFIX = "Fix grammatical errors in this sentence: "
"""A CoEdIT-style instruction: T5 test models learn to copy the text after it and never the prefix."""
T5_LAYOUTS = {  # (transformers class, its config fields): every one with d_kv * num_heads != d_model
    # v1.0: ReLU, the output projection tied to the embedding (states rescaled by d_model ** -0.5), the
    # embedding padded past the tokenizer; short buckets, so that distances reach the log buckets and past
    "t5": ("T5", dict(feed_forward_proj="relu", d_kv=12, num_heads=4, relative_attention_num_buckets=8,
                      relative_attention_max_distance=20)),
    # v1.1 / Flan-T5: gated GELU-tanh, a separate lm_head (transformers 5 caches a decoder deeper than
    # the encoder wrongly, so the layers are as many: tests/tiny_models.py has a deeper decoder)
    "t5-v1.1": ("T5", dict(feed_forward_proj="gated-gelu", d_kv=6, num_heads=4)),
    "mt5": ("MT5", dict(feed_forward_proj="gated-gelu", d_kv=12, num_heads=3)),  # mT5: gated, lm_head
    # umT5: a bias table in every self-attention layer, short buckets as v1.0's
    "umt5": ("UMT5", dict(feed_forward_proj="gated-gelu", d_kv=12, num_heads=3, relative_attention_num_buckets=8,
                          relative_attention_max_distance=20)),
}


def t5_pairs(tok, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """Copy pairs, half of them with TASK_PREFIX on the source (never on the target)."""
    return [(tok(TASK_PREFIX * (i % 2) + t).input_ids, tok(t).input_ids) for i, t in enumerate(texts)]


def build_t5(out: Path, layout: str = "t5", steps: int = 200, seed: int = 0) -> Path:
    """A T5-family directory as transformers saves it (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json) plus the spiece.model it was made from, as Hugging Face hub directories
    hold: T5's sentencepiece layout (pad 0, </s> 1, <unk> 2), 10 sentinels <extra_id_i>, a copy task
    with a task prefix on half the sources (`t5_pairs`; steps=0: random weights). Layouts:
    `T5_LAYOUTS`."""
    import transformers
    from torch import nn

    out.mkdir(parents=True, exist_ok=True)
    texts = synthetic_sentences(400, seed)
    spm_file = _spm(out, texts + [TASK_PREFIX] * 20, 150, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    spm_file.rename(out / "spiece.model")
    work = out / "tok"
    work.mkdir()
    (work / "spiece.model").write_bytes((out / "spiece.model").read_bytes())
    tok = transformers.T5Tokenizer.from_pretrained(str(work), extra_ids=10)
    family, fields = T5_LAYOUTS[layout]
    torch.manual_seed(seed)
    untied = fields["feed_forward_proj"] != "relu"
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=len(tok) + (6 if not untied else 0), d_model=32, d_ff=64, num_layers=2, dropout_rate=0.0,
        decoder_start_token_id=0, tie_word_embeddings=not untied, **fields)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(cfg)
    if untied:  # transformers ties lm_head to the embedding unless it is a parameter of its own
        model.lm_head.weight = nn.Parameter(model.shared.weight.detach().clone())
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 1.0)
    if steps:
        _train(model, t5_pairs(tok, texts), cfg.pad_token_id, steps, seed)
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    return out
