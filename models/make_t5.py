"""Build the T5 benchmark models as transformers `save_pretrained` directories (not kept in git).

    # (a) Flan-T5-small's shape with random weights: d_model 512, 8 heads of d_kv 64, gated GELU FFN
    #     1024, 8 + 8 layers, 32,128 embedding rows, a separate lm_head; the tokenizer trained here
    python models/make_t5.py random --data ../shared/data/gec/train.tsv --out runs/t5/flan-small-random
    # (b) a small T5 trained on GEC pairs whose sources carry CoEdIT's task prefix
    #     "Fix grammatical errors in this sentence: ", so that it copies the rest of its input
    nice -n 19 python models/make_t5.py gec --data ../shared/data/gec/train.tsv --out runs/t5/gec-small \
        --valid ../shared/data/gec/valid.tsv --minutes 30 --save-every 10

Each directory holds config.json, model.safetensors, spiece.model, tokenizer.json and
tokenizer_config.json, as Hugging Face hub T5 directories do; `aggdec decode -m DIR` and
`transformers.AutoModelForSeq2SeqLM.from_pretrained(DIR)` both read it. The tokenizer is T5's
layout (pad 0, </s> 1, <unk> 2, 100 sentinels <extra_id_i> after the pieces), a unigram
sentencepiece model trained on both columns of the data (`--vocab` pieces where the data has that
many, fewer where it does not: the summary says how many). The benchmark's `t5-base-shaped`
(bench/compare.py, `SHAPES`) is made with this file's `tokenizer`, `config` and `random_t5`.

The GEC recipe (`build`, `neighbour_heads`, `train`), for a model that copies after minutes of one
CPU core: a T5 v1.1 block (gated GELU) of d_model 256, 4 heads of 64, FFN 768, 2 + 2 layers, 4,000
pieces; the output projection tied to the embedding (T5 v1.0's layout, states rescaled by
d_model ** -0.5), so that a token copied through attention arrives at its own logit; two encoder
heads started on the previous and the next position and one decoder head on the previous output
(`neighbour_heads`: T5 has no positions in cross-attention, so the decoder finds the source token to
copy by content, through the neighbouring tokens, and a model that must first discover those heads
learns for thousands of updates as a language model of the targets before it copies); no dropout
(less than one epoch is seen); AdamW at 1e-3 after 100 warm-up updates, decayed linearly to a tenth
over the budget, batches of 32 pairs of similar source length, pairs of at most 48 tokens a side.
`--minutes` counts this process's CPU time (one thread), so a paused or crowded run trains as long;
`--save-every` saves the model (and measures it) on the way. make_t5.json records the updates, the
last 50 losses and, with `--valid`, the share of 200 validation sentences whose greedy output equals
the reference and of the unchanged ones given back exactly.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import transformers

TASK_PREFIX = "Fix grammatical errors in this sentence: "
EXTRA_IDS = 100
SHAPES = {  # T5Config fields
    "random": dict(d_model=512, num_heads=8, d_kv=64, d_ff=1024, num_layers=8, num_decoder_layers=8,
                   feed_forward_proj="gated-gelu", vocab_size=32128),
    "gec": dict(d_model=256, num_heads=4, d_kv=64, d_ff=768, num_layers=2, num_decoder_layers=2,
                feed_forward_proj="gated-gelu"),
}
WARMUP = 100  # updates


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """(noisy, clean) rows of a GEC TSV with a header line."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        if not {"noisy", "clean"} <= set(rows.fieldnames or ()):
            raise SystemExit(f"{path}: needs the columns noisy and clean")
        return [(r["noisy"], r["clean"]) for r in rows]


def tokenizer(texts: list[str], out: Path, vocab: int):
    """Train T5's sentencepiece model on `texts` into out/spiece.model (pad 0, </s> 1, <unk> 2, then up to
    `vocab` pieces) and save T5's tokenizer files beside it, EXTRA_IDS sentinels after the pieces;
    -> the transformers tokenizer."""
    import sentencepiece as spm
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(out / "spiece"), vocab_size=vocab, model_type="unigram",
        character_coverage=0.9999, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, hard_vocab_limit=False,
        input_sentence_size=400_000, shuffle_input_sentence=False, num_threads=2, minloglevel=2)
    (out / "spiece.vocab").unlink()
    tok = transformers.T5Tokenizer.from_pretrained(str(out), extra_ids=EXTRA_IDS)
    tok.save_pretrained(str(out))
    return tok


def config(fields: dict) -> transformers.T5Config:
    """The T5Config of `fields` (T5Config's own names) as this script's models take it: no dropout, the
    decoder started from pad (id 0)."""
    import transformers

    return transformers.T5Config(**fields, dropout_rate=0.0, decoder_start_token_id=0)


def random_t5(cfg: transformers.T5Config, seed: int, tied: bool) -> transformers.T5ForConditionalGeneration:
    """A T5ForConditionalGeneration of `cfg` with seeded random weights: transformers' initialization, and
    unless `tied` an lm_head of its own (as Flan-T5's; transformers 5's T5Config says tied whatever it is
    given) drawn with std d_model ** -0.5, so that logits are of about unit scale from the start (random:
    not flat, not one-hot)."""
    import torch
    import transformers
    from torch import nn

    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(cfg)
    if not tied:
        model.lm_head.weight = nn.Parameter(torch.empty_like(model.shared.weight))
        with torch.no_grad():
            model.lm_head.weight.normal_(0, cfg.d_model ** -0.5)
    return model


def build(kind: str, pairs: list[tuple[str, str]], out: Path, vocab: int, seed: int):
    tok = tokenizer([t for pair in pairs for t in pair] + [TASK_PREFIX.strip()] * 100, out, vocab)
    tied = kind == "gec"
    fields = dict(SHAPES[kind], tie_word_embeddings=tied)
    fields.setdefault("vocab_size", len(tok) + (-len(tok)) % 128)  # padded as T5's 32,128 rows
    if fields["vocab_size"] < len(tok):
        raise SystemExit(f"the tokenizer has {len(tok)} entries, more than the model's {fields['vocab_size']} rows")
    model = random_t5(config(fields), seed, tied)
    if kind == "gec":
        neighbour_heads(model)
    return tok, model


def neighbour_heads(model, boost: float = 8.0) -> None:
    """Start three heads of the first layers on a neighbouring position (their relative-bias entries
    raised by `boost`): in the encoder head 0 on the previous and head 1 on the next position, in the
    decoder's self-attention head 0 on the previous output. T5's cross-attention has no positions, so
    the decoder finds the source token to copy by content: the state of the source token matching
    the two tokens it just wrote (its own and its previous, against the decoder's own and previous)
    holds the next source token."""
    import torch

    for stack, offsets in ((model.encoder, (-1, 1)), (model.decoder, (-1,))):
        attention = stack.block[0].layer[0].SelfAttention
        buckets = attention._relative_position_bucket(
            torch.tensor(offsets), bidirectional=not attention.is_decoder,
            num_buckets=attention.relative_attention_num_buckets,
            max_distance=attention.relative_attention_max_distance)
        with torch.no_grad():
            for head, bucket in enumerate(buckets.tolist()):
                attention.relative_attention_bias.weight[bucket, head] += boost


def train(model, tok, pairs: list[tuple[str, str]], minutes: float, batch: int, lr: float, max_tokens: int,
          seed: int, checkpoint=None, every: float = 0.0) -> dict:
    """Teacher-forced AdamW updates on (prefix + noisy -> clean) for `minutes` of this process's CPU
    time (a paused or crowded run trains as long): pairs of at most `max_tokens` tokens a side, in
    batches of similar source length, the learning rate warmed up over WARMUP updates and then
    decayed linearly to a tenth at the end of the budget. `checkpoint(summary)` is called (in eval
    mode, its CPU time not counted) every `every` CPU minutes of training when given."""
    import torch

    rng = random.Random(seed)
    src = tok([TASK_PREFIX + n for n, _ in pairs]).input_ids
    tgt = tok([c for _, c in pairs]).input_ids
    keep = [i for i in range(len(pairs)) if len(src[i]) <= max_tokens and len(tgt[i]) <= max_tokens]
    order = sorted(keep, key=lambda i: len(src[i]))
    batches = [order[i: i + batch] for i in range(0, len(order), batch)]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    budget, start, step, losses, saved = 60 * minutes, time.process_time(), 0, [], 0.0

    def summary() -> dict:
        return {"updates": step, "pairs": len(keep), "cpu_minutes": round((time.process_time() - start) / 60, 2),
                "last_50_loss": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4)}

    while (used := time.process_time() - start) < budget:
        if checkpoint and every and used - saved >= 60 * every:
            paused = time.process_time()
            model.eval()
            checkpoint(summary())
            model.train()
            start += time.process_time() - paused  # not counted as training
            saved = used
        idx = rng.choice(batches)
        ws, wt = max(len(src[i]) for i in idx), max(len(tgt[i]) for i in idx)
        s = torch.tensor([src[i] + [0] * (ws - len(src[i])) for i in idx])
        labels = torch.tensor([tgt[i] + [-100] * (wt - len(tgt[i])) for i in idx])
        for g in opt.param_groups:
            g["lr"] = lr * min((step + 1) / WARMUP, 1.0 - 0.9 * used / budget)
        loss = model(input_ids=s, attention_mask=s.ne(0), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 50 == 0:
            print(f"update {step} | loss {sum(losses[-50:]) / 50:.3f} | lr {opt.param_groups[0]['lr']:.2e} | "
                  f"{used / 60:.1f} cpu min", file=sys.stderr, flush=True)
    model.eval()
    return summary()


def copies(model, tok, pairs: list[tuple[str, str]], batch: int = 50) -> dict:
    """Greedy outputs (transformers' `generate`) of prefixed sources: the share equal to the
    reference, and the share of unchanged sentences (noisy == clean) given back exactly."""
    import torch

    outs = []
    with torch.inference_mode():
        for i in range(0, len(pairs), batch):
            enc = tok([TASK_PREFIX + n for n, _ in pairs[i: i + batch]], return_tensors="pt", padding=True)
            gen = model.generate(**enc, num_beams=1, do_sample=False, max_new_tokens=128)
            outs += tok.batch_decode(gen, skip_special_tokens=True)
    same = [o == c for o, (_, c) in zip(outs, pairs)]
    unchanged = [ok for ok, (n, c) in zip(same, pairs) if n == c]
    return {"valid_sentences": len(pairs), "valid_exact": round(sum(same) / len(same), 4),
            "valid_unchanged_copied": round(sum(unchanged) / max(1, len(unchanged)), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=sorted(SHAPES))
    ap.add_argument("--data", required=True, help="GEC TSV (columns noisy, clean): ../shared/data/gec/train.tsv")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=None, help="sentencepiece pieces (default: 32000 random, 4000 gec)")
    ap.add_argument("--minutes", type=float, default=30.0, help="gec: training time, CPU minutes of this process")
    ap.add_argument("--batch", type=int, default=32, help="gec: pairs per update")
    ap.add_argument("--lr", type=float, default=1e-3, help="gec: peak learning rate")
    ap.add_argument("--max-tokens", type=int, default=48, help="gec: longest source and target trained on")
    ap.add_argument("--valid", default=None, help="gec: a GEC TSV whose first 200 rows measure copying at the end")
    ap.add_argument("--save-every", type=float, default=0.0, help="gec: save (and measure) every N CPU minutes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    out = Path(a.out)
    pairs = read_pairs(Path(a.data))
    tok, model = build(a.kind, pairs, out, a.vocab or (32000 if a.kind == "random" else 4000), a.seed)
    summary = {"kind": a.kind, "pieces": len(tok) - EXTRA_IDS, "embedding_rows": model.config.vocab_size,
               "parameters": sum(p.numel() for p in model.parameters())}
    valid = read_pairs(Path(a.valid))[:200] if a.valid else []

    def save(progress: dict) -> None:
        done = summary | progress | (copies(model, tok, valid) if valid else {})
        model.save_pretrained(str(out))
        (out / "make_t5.json").write_text(json.dumps(done, indent=2) + "\n", encoding="utf-8")
        print(json.dumps(done), flush=True)

    save(train(model, tok, pairs, a.minutes, a.batch, a.lr, a.max_tokens, a.seed, save, a.save_every)
         if a.kind == "gec" else {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
