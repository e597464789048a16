"""IAD vs greedy vs beam-5 (and CTranslate2 greedy) on gec/test, CPU, one run, side by side.

    python bench/iad_bench.py --model models/gec-base --data ../shared/data/gec/test.tsv \
        --batch-sizes 1,8,32,64 --out bench/results/iad.json

Reports per batch size: sentences/s, output tokens/s, speedups (IAD/greedy, IAD/beam), best-vs-best
throughput, verifier calls per sentence against the oracle bound (1 + edited spans between input and
greedy output), verifier tokens computed per output token (fed and padded), identical share against
greedy, and per-sentence speedup by edit-ratio bucket at batch 1 (the paper's Figure 5).

`--precisions fp32,bf16-certified` runs greedy and IAD with each verifier top-1 (methods named
`@bf16c` use the certified bf16 projection); speedups compare methods of the same precision, and
`x_greedy_fp32` compares with fp32 greedy.
"""

from __future__ import annotations

import argparse
import difflib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from baseline_bench import add_run_args, ctranslate2_greedy, export_ct2, greedy_like, machine, with_precision

from aggdec.api import Translator
from aggdec.decoding.beam import beam_search
from aggdec.decoding.drafters import NoDraft
from aggdec.decoding.iad import InputCopy
from aggdec.decoding.limits import max_len_for
from aggdec.decoding.loop import DraftVerifyLoop
from aggdec.decoding.metadata import Request
from aggdec.model.projection import OutputProjection
from aggdec.fairseq_io import save_fairseq
from aggdec.train.ar import read_tsv


def edit_spans(a: list[int], b: list[int]) -> tuple[int, int]:
    """(number of edited spans, edited tokens) turning a into b."""
    ops = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    return len(ops), sum(max(i2 - i1, j2 - j1) for _, i1, i2, j1, j2 in ops)


def iad_drafter(variant: str) -> InputCopy:
    """'none' | 'N' | 'adaptiveN', optionally suffixed '+sub' (substitution fallback) and/or
    '+near' (nearest_match re-alignment)."""
    cap, *extras = variant.split("+")
    unknown = set(extras) - {"sub", "near"}
    if unknown:
        raise ValueError(f"--draft-caps: unknown IAD option(s) {sorted(unknown)} in {variant!r}")
    kw = dict(substitution="sub" in extras, nearest_match="near" in extras)
    if cap == "none":
        return InputCopy(**kw)
    if cap.startswith("adaptive"):
        return InputCopy(max_draft=int(cap.removeprefix("adaptive")), adaptive=True, **kw)
    return InputCopy(max_draft=int(cap), **kw)


def run_loop(model, reqs, drafter, bs, projection=None):
    loop = DraftVerifyLoop(model, drafter, max_batch_size=bs, projection=projection)
    t0 = time.perf_counter()
    hyps = {h.index: h for h in loop.run(reqs)}
    return hyps, time.perf_counter() - t0, loop.counters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/gec-base")
    ap.add_argument("--data", default="../shared/data/gec/test.tsv")
    ap.add_argument("--column", default="noisy")
    add_run_args(ap, batch_sizes="1,8,32,64")
    ap.add_argument("--methods", default="beam,greedy,iad")
    ap.add_argument("--draft-caps", default="none",
                    help="IAD variants to try: cap ('none', an int, or 'adaptiveN'), optionally '+sub' for the "
                         "substitution fallback and '+near' for nearest-match re-alignment, e.g. none,16+sub+near")
    ap.add_argument("--ct2", action="store_true", help="add CTranslate2 greedy on the same weights (needs ctranslate2)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (CTranslate2 runs on the CPU only)")
    ap.add_argument("--out", default="bench/results/iad.json")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    tr = Translator.load(args.model, device=args.device)
    model, cfg = tr.model, tr.cfg
    sources = read_tsv(args.data, args.column, args.column)[0][: args.limit]
    reqs_all = []
    for i, s in enumerate(sources):
        ids, status, _ = tr.prepare(s)
        if ids is not None:
            reqs_all.append(Request(i, ids, max_len_for(len(ids), 1.5, 10, cfg.max_target_positions)))
    results: dict = {"model": args.model, "sha": tr.bundle.sha, "data": args.data, "sentences": len(reqs_all),
                     "threads": args.threads, "device": args.device,
                     "machine": machine(args.device),
                     "torch": torch.__version__, "runs": []}
    greedy_ref: dict[int, list[int]] = {}
    per_sentence_ms: dict[str, dict[int, float]] = {}
    caps = [c.strip() for c in args.draft_caps.split(",")]
    projections = {p: OutputProjection(model.output_weight, certify=p == "bf16-certified", bias=model.output_bias) for p in args.precisions.split(",")}
    # warm-up
    run_loop(model, reqs_all[:8], NoDraft(), 8)
    ct2_dir = export_ct2(save_fairseq(args.model, Path(tempfile.mkdtemp()) / "fs"), Path(tempfile.mkdtemp())) if args.ct2 else None

    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        reqs = reqs_all[: args.bs1_limit] if bs == 1 and args.bs1_limit else reqs_all
        configs = [(m, c, p) for m in args.methods.split(",") for p in (projections if m != "beam" else ["fp32"])
                   for c in (caps if m == "iad" else [None])]
        times: dict[str, list[float]] = {}
        for rep in range(args.repeat):  # repeats interleave the methods; the median time is reported
            for method, cap, prec in configs:
                name = with_precision(method if method != "iad" or cap == "none" else f"iad-{cap}", prec)
                projections[prec].reset_counts()
                if method == "beam":
                    t0 = time.perf_counter()
                    hyp_list = beam_search(model, reqs, beam=5, max_batch_size=bs)
                    secs = time.perf_counter() - t0
                    hyps = {h.index: h for h in hyp_list}
                    counters = None
                else:
                    drafter = NoDraft() if method == "greedy" else iad_drafter(cap)
                    hyps, secs, counters = run_loop(model, reqs, drafter, bs, projections[prec])
                times.setdefault(name, []).append(secs)
                if rep < args.repeat - 1:
                    continue
                secs = statistics.median(times[name])
                toks = sum(len(h.tokens) + 1 for h in hyps.values())
                if method == "greedy" and prec == "fp32":
                    for i, h in hyps.items():
                        greedy_ref.setdefault(i, h.tokens)
                same = [hyps[r.index].tokens == greedy_ref[r.index] for r in reqs if r.index in greedy_ref]
                run = {"method": name, "batch_size": bs, "sentences": len(reqs), "seconds": secs, "seconds_all": times[name],
                       "sentences_per_s": len(reqs) / secs, "tokens_per_s": toks / secs,
                       "identical_to_greedy": (sum(same) / len(same)) if same else None}
                if counters is not None:
                    iters = [h.stats.iterations for h in hyps.values()]
                    run.update(calls=counters.calls, mean_iterations=statistics.mean(iters),
                               fed_per_output_token=counters.fed / toks, padded_per_output_token=counters.padded / toks,
                               mean_accepted_per_iter=sum(h.stats.accepted for h in hyps.values()) / sum(iters))
                    if projections[prec].certify:
                        run.update(projections[prec].counts())
                    if method == "iad" and greedy_ref:
                        bound = [1 + edit_spans(r.src[:-1], greedy_ref[r.index])[0] for r in reqs]
                        run["oracle_mean_iterations"] = statistics.mean(bound)
                if bs == 1 and method != "beam":
                    per_sentence_ms[name] = {i: h.stats.decode_ms for i, h in hyps.items()}
                results["runs"].append(run)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in run.items()}), flush=True)
        if args.ct2 and "greedy" in args.methods:
            sp = tr.bundle.src_tok.sp
            pieces = [sp.id_to_piece(r.src[:-1]) for r in reqs]
            outs, secs = ctranslate2_greedy(ct2_dir, pieces, bs, args.threads, max(r.max_len for r in reqs) + 1)
            ct2_ids = [[sp.piece_to_id(p) for p in o] for o in outs]
            same = [ct2_ids[k] == greedy_ref.get(r.index) for k, r in enumerate(reqs)]
            toks = sum(len(o) + 1 for o in ct2_ids)
            run = {"method": "ctranslate2-greedy", "batch_size": bs, "sentences": len(reqs), "seconds": secs,
                   "sentences_per_s": len(reqs) / secs, "tokens_per_s": toks / secs,
                   "identical_to_greedy": sum(same) / len(same)}
            results["runs"].append(run)
            print(json.dumps(run), flush=True)

    summarize(results, per_sentence_ms, reqs_all, greedy_ref)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def summarize(results: dict, per_sentence_ms: dict, reqs: list[Request], greedy_ref: dict) -> None:
    runs = results["runs"]
    by = {(r["method"], r["batch_size"]): r for r in runs}
    methods = sorted({r["method"] for r in runs})
    table = []
    def ratio(r, other):
        return round(r["sentences_per_s"] / other["sentences_per_s"], 2) if other and other["sentences"] == r["sentences"] else None

    for (m, bs), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        g, b = by.get((greedy_like(m), bs)), by.get(("beam", bs))
        row = {"method": m, "bs": bs, "sent/s": round(r["sentences_per_s"], 2), "tok/s": round(r["tokens_per_s"], 1),
               "x_greedy": ratio(r, g), "x_greedy_fp32": ratio(r, by.get(("greedy", bs))),
               "x_beam": ratio(r, b),
               "identical": r.get("identical_to_greedy")}
        table.append(row)
    best = {m: max((r for r in runs if r["method"] == m), key=lambda r: r["sentences_per_s"]) for m in methods}
    results["table"] = table
    results["best_vs_best"] = {m: {"batch_size": r["batch_size"], "sentences_per_s": r["sentences_per_s"]} for m, r in best.items()}
    greedy_best = max((r for m, r in best.items() if m.startswith("greedy")), key=lambda r: r["sentences_per_s"], default=None)
    if greedy_best:  # against the fastest greedy of any precision
        for m in best:
            results["best_vs_best"][m]["x_greedy"] = best[m]["sentences_per_s"] / greedy_best["sentences_per_s"]
    if "greedy" in per_sentence_ms:
        buckets: dict[str, list[float]] = {}
        src = {r.index: r.src[:-1] for r in reqs}
        for name, ms in per_sentence_ms.items():
            greedy_ms = per_sentence_ms.get(greedy_like(name), {})
            if not name.startswith("iad"):
                continue
            for i, t in ms.items():
                if i not in greedy_ms or t <= 0:
                    continue
                _, edited = edit_spans(src[i], greedy_ref[i])
                share = edited / max(1, len(src[i]))
                key = "0" if share == 0 else "(0,.1]" if share <= 0.1 else "(.1,.2]" if share <= 0.2 else "(.2,.4]" if share <= 0.4 else ">.4"
                buckets.setdefault(f"{name}|{key}", []).append(greedy_ms[i] / t)
        results["speedup_by_edit_ratio_bs1"] = {k: {"n": len(v), "median_speedup": statistics.median(v)} for k, v in sorted(buckets.items())}
    print("\n" + " | ".join(table[0].keys()) if table else "")
    for row in table:
        print(" | ".join(str(v) for v in row.values()))
    print("best vs best:", json.dumps(results["best_vs_best"]))
    if "speedup_by_edit_ratio_bs1" in results:
        print("per-sentence speedup by edit ratio (bs=1):", json.dumps(results["speedup_by_edit_ratio_bs1"]))


if __name__ == "__main__":
    sys.exit(main())
