"""GAD, GAD++ and blockwise decoding vs greedy and beam-5 on ende/test, one run, side by side.

    python bench/gad_bench.py --model models/ende-base --drafter models/ende-base-drafter \
        --heads models/ende-base-heads --batch-sizes 1,64 --bs1-limit 500 --out bench/results/gad.json

For each batch size and method: sentences/s, speedup over greedy and beam-5 at that batch size,
verifier calls per sentence, output tokens per call (the paper's "Tok."), accepted draft tokens
per call, BLEU and chrF (sacrebleu, signature printed) and the share of outputs identical to greedy.
Lossless methods (gad, blockwise without min-block) must show identical = 1.0.
`--precisions fp32,bf16-certified` also runs each method with the certified bf16 verifier top-1 and
bf16 drafters (named `@bf16c`); speedups compare methods of the same precision. `--repeat N` runs
every method N times, interleaved, and reports the median time (this machine is noisy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import sacrebleu
import torch
from baseline_bench import add_run_args, greedy_like, machine, with_precision

from aggdec.api import DecodeOptions, Translator, decode_options
from aggdec.train.ar import read_tsv


def method_table(drafter: str | None, heads: str | None, gadpp_k: int) -> dict[str, DecodeOptions]:
    """Name -> options; methods whose model is missing are left out."""
    m = {"beam5": decode_options("beam", beam=5), "greedy": decode_options("greedy")}
    if drafter:
        m["gad-k4"] = decode_options("gad", drafter=drafter, block_size=4)
        m["gad-k10"] = decode_options("gad", drafter=drafter, block_size=10)
        m["gad-k25"] = decode_options("gad", drafter=drafter, block_size=25)
        m["gad-k25-adaptive"] = decode_options("gad", drafter=drafter, block_size=25, adaptive_draft=True)
        m["gad++-b3-t1"] = decode_options("gad++", drafter=drafter, block_size=gadpp_k, top_beta=3, tau=1.0)
        m["gad++-b5-t3"] = decode_options("gad++", drafter=drafter, block_size=gadpp_k, top_beta=5, tau=3.0)
    if heads:
        m["blockwise-k4"] = decode_options("blockwise", drafter=heads, block_size=4)
        m["blockwise-k8"] = decode_options("blockwise", drafter=heads, block_size=8)
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/ende-base")
    ap.add_argument("--drafter", default="models/ende-base-drafter")
    ap.add_argument("--heads", default="models/ende-base-heads")
    ap.add_argument("--data", default="../shared/data/ende/test.tsv")
    ap.add_argument("--src-col", default="en")
    ap.add_argument("--ref-col", default="de")
    add_run_args(ap, batch_sizes="1,64")
    ap.add_argument("--methods", default=None, help="comma list (default: all whose models exist)")
    ap.add_argument("--gadpp-block-size", type=int, default=25)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench/results/gad.json")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    tr = Translator.load(args.model, device=args.device)
    drafter = args.drafter if args.drafter and Path(args.drafter).is_dir() else None
    heads = args.heads if args.heads and Path(args.heads).is_dir() else None
    table = method_table(drafter, heads, args.gadpp_block_size)
    names = [n.strip() for n in args.methods.split(",")] if args.methods else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--methods: unknown or unavailable {unknown}; available: {sorted(table)}")
    src_all, ref_all = read_tsv(args.data, args.src_col, args.ref_col)
    src_all, ref_all = src_all[: args.limit], ref_all[: args.limit]
    tr.translate_batch(src_all[:16], decode_options(max_batch_size=16))  # warm-up
    for n in names:
        for prec in args.precisions.split(","):
            if table[n].drafter:  # loads the drafter in this precision outside the timed runs
                tr.translate_batch(src_all[:4], dataclasses.replace(table[n], verify_precision=prec))

    results: dict = {"model": args.model, "sha": tr.bundle.sha, "drafter": drafter, "heads": heads,
                     "data": args.data, "device": args.device, "threads": args.threads,
                     "machine": machine(args.device),
                     "torch": torch.__version__, "runs": []}
    signature = {}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        n_sent = args.bs1_limit if bs == 1 and args.bs1_limit else len(src_all)
        src, ref = src_all[:n_sent], ref_all[:n_sent]
        greedy_tokens = None
        precisions = args.precisions.split(",")
        configs = [(n, p) for n in names for p in (precisions if n != "beam5" else ["fp32"])]
        times: dict[str, list[float]] = {}
        for rep, (base, prec) in [(r, c) for r in range(args.repeat) for c in configs]:  # interleaved repeats
            name = with_precision(base, prec)
            opts = dataclasses.replace(table[base], max_batch_size=bs, verify_precision=prec)
            projection = tr.projection(prec)
            projection.reset_counts()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = tr.translate_batch(src, opts)
            times.setdefault(name, []).append(time.perf_counter() - t0)
            if rep < args.repeat - 1:
                continue
            secs = statistics.median(times[name])
            hyps = [r.text for r in out]
            bleu_metric, chrf_metric = sacrebleu.BLEU(), sacrebleu.CHRF()
            bleu = bleu_metric.corpus_score(hyps, [ref])
            chrf = chrf_metric.corpus_score(hyps, [ref])
            signature = {"bleu": str(bleu_metric.get_signature()), "chrf": str(chrf_metric.get_signature())}
            ok = [r for r in out if r.status not in ("empty", "error")]
            calls = sum(r.stats.iterations for r in ok)
            run = {"method": name, "batch_size": bs, "sentences": len(src), "seconds": secs, "seconds_all": times[name],
                   "sentences_per_s": len(src) / secs, "bleu": bleu.score, "chrf": chrf.score,
                   "options": {k: v for k, v in dataclasses.asdict(opts).items() if k != "drafter"}}
            if name == "greedy":
                greedy_tokens = [r.tokens for r in out]
            if greedy_tokens is not None:
                run["identical_to_greedy"] = statistics.mean(a.tokens == b for a, b in zip(out, greedy_tokens))
            if calls:
                run["calls_per_sentence"] = calls / len(ok)
                run["tokens_per_call"] = sum(len(r.tokens) + 1 for r in ok) / calls
                run["accepted_per_call"] = sum(r.stats.accepted for r in ok) / calls
                drafted = sum(r.stats.drafted for r in ok)
                run["draft_acceptance"] = sum(r.stats.accepted for r in ok) / drafted if drafted else None
            if projection.certify and opts.lossless:  # lossy methods read fp32 logits, not the top-1
                run.update(projection.counts())
            results["runs"].append(run)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in run.items() if k != "options"}),
                  flush=True)
    results["sacrebleu"] = signature
    summarize(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def summarize(results: dict) -> None:
    by = {(r["method"], r["batch_size"]): r for r in results["runs"]}
    rows = []
    for (m, bs), r in by.items():
        g, b = by.get((greedy_like(m), bs)), by.get(("beam5", bs))
        rows.append({"method": m, "bs": bs, "sent/s": round(r["sentences_per_s"], 2),
                     "x_greedy": round(r["sentences_per_s"] / g["sentences_per_s"], 2) if g else None,
                     "x_beam5": round(r["sentences_per_s"] / b["sentences_per_s"], 2) if b else None,
                     "tok/call": round(r["tokens_per_call"], 2) if "tokens_per_call" in r else None,
                     "BLEU": round(r["bleu"], 2), "chrF": round(r["chrf"], 2),
                     "identical": round(r["identical_to_greedy"], 4) if "identical_to_greedy" in r else None})
    results["table"] = rows
    print("\n" + " | ".join(rows[0]) if rows else "")
    for row in rows:
        print(" | ".join(str(v) for v in row.values()))
    print("sacrebleu:", json.dumps(results.get("sacrebleu")))


if __name__ == "__main__":
    sys.exit(main())
