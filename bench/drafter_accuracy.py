"""How well a GAD drafter predicts its verifier: teacher-forced accuracy by block position.

    python bench/drafter_accuracy.py --drafter models/ende-base-drafter runs/gpu4/drafter \
        --limit 1000 --out bench/results/drafter-accuracy.json

The targets are the verifier's own greedy outputs on the first `--limit` sources of `--data` (not
the training data), made with the project's batched greedy decoding. Each output is cut at every
point c (0 .. len) and the drafter predicts the next k tokens from [eos, y_1..y_c, k masks], the
layout GAD decodes with. Reported per drafter: accuracy at block positions 1..k, and the mean
accepted prefix (the number of leading correct tokens, what top-1 verification keeps per call).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from baseline_bench import machine

from aggdec import checkpoint
from aggdec.api import Translator, decode_options
from aggdec.train.ar import PAD, read_tsv
from aggdec.train.drafter import block_layout_batch


def block_accuracy(drafter, src: list[list[int]], out: list[list[int]], k: int, batch_rows: int = 256) -> dict:
    """Teacher-forced accuracy over every cut point of every output. src/out: token ids without eos."""
    mask_id = drafter.model.cfg.tgt_vocab - 1
    pairs = [(i, c) for i, y in enumerate(out) for c in range(len(y) + 1)]
    correct = torch.zeros(k)
    counted = torch.zeros(k)
    prefix_sum = 0.0
    model = drafter.model.eval()
    with torch.inference_mode():
        for start in range(0, len(pairs), batch_rows):
            chunk = pairs[start : start + batch_rows]
            s, seq, limit, target = block_layout_batch([src[i] for i, _ in chunk], [out[i] for i, _ in chunk],
                                                       [c for _, c in chunk], k, mask_id)
            hidden = model(s, seq, key_limit=limit, return_hidden=True)
            is_mask = seq.eq(mask_id)
            logits = model.output_logits(hidden[is_mask])
            logits[:, mask_id] = -float("inf")
            pred = logits.argmax(-1).view(len(chunk), k)
            gold = target[is_mask].view(len(chunk), k)
            real = gold.ne(PAD)  # blocks that run past eos have fewer gold tokens
            hit = pred.eq(gold) & real
            correct += hit.sum(0).float()
            counted += real.sum(0).float()
            prefix_sum += float(torch.cumprod(hit.long(), dim=1).sum())
    return {"cuts": len(pairs), "accuracy_by_position": (correct / counted.clamp(min=1)).tolist(),
            "mean_accepted_prefix": prefix_sum / len(pairs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/ende-base")
    ap.add_argument("--drafter", nargs="+", default=["models/ende-base-drafter"])
    ap.add_argument("--data", default="../shared/data/ende/valid.tsv")
    ap.add_argument("--src-col", default="en")
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--block-size", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/drafter-accuracy.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tr = Translator.load(args.model)
    sources, _ = read_tsv(args.data, args.src_col, args.src_col)
    prepared = [(s, tr.prepare(s)[0]) for s in sources[: args.limit]]
    prepared = [(s, ids) for s, ids in prepared if ids is not None]  # empty sources have no output
    sources, src = [s for s, _ in prepared], [ids[:-1] for _, ids in prepared]
    results = tr.translate_batch(sources, decode_options("greedy", max_batch_size=64, verify_precision="fp32"))
    out = [r.tokens for r in results]
    report = {"model": args.model, "sha": tr.bundle.sha, "data": args.data, "sentences": len(sources),
              "block_size": args.block_size, "machine": machine("cpu"), "drafters": {}}
    for path in args.drafter:
        drafter = checkpoint.load(path)
        if drafter.meta.get("verifier_sha") != tr.bundle.sha:
            raise SystemExit(f"{path}: drafter of verifier {drafter.meta.get('verifier_sha')}, not {tr.bundle.sha}")
        acc = block_accuracy(drafter, src, out, args.block_size)
        acc.update(updates=drafter.meta.get("updates"), minutes=drafter.meta.get("minutes"))
        report["drafters"][path] = acc
        print(f"{path}: updates {acc['updates']}, accuracy by position "
              + " ".join(f"{a:.2f}" for a in acc["accuracy_by_position"])
              + f", mean accepted prefix {acc['mean_accepted_prefix']:.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
