"""GAD, GAD++ (and blockwise) against greedy, beam-5 and CTranslate2 on ende/test, side by side.

    python bench/gad_bench.py --draft-head models/ende-base-draft-head --batch-sizes 1,8,64,128 \
        --bs1-limit 200 --limit 1000 --repeat 3 --ct2 --out bench/results/gad.json

Per batch size and method: sentences/s (median of `--repeat` interleaved runs), speedup over our
greedy, output tokens per verifier call, model calls per output token (verifier calls, plus drafter
calls for drafters that run as a model call of their own), the drafter's share of the decoding time,
BLEU and chrF (sacrebleu, signature in the JSON) and the share of outputs identical to greedy.
CTranslate2 greedy on the same weights (float32 and int8) runs in a separate process per batch size
(two OpenMP runtimes in one process slow each other down). Not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sacrebleu
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from baseline_bench import export_ct2, machine

from aggdec.api import Translator, decode_options
from aggdec.decoding.limits import max_len_for
from aggdec.decoding.metadata import Request
from aggdec.decoding.methods import get_method
from aggdec.fairseq_io import save_fairseq
from aggdec.train.ar import read_tsv

BLEU, CHRF = sacrebleu.BLEU(), sacrebleu.CHRF()

CT2_CHILD = r"""
import json, sys, time, ctranslate2
args = json.loads(sys.argv[1])
pieces = json.load(open(args["pieces"]))
tr = ctranslate2.Translator(args["model"], device="cpu", compute_type=args["compute_type"], inter_threads=1,
                            intra_threads=args["threads"])
tr.translate_batch(pieces[:8], beam_size=1, max_batch_size=8)
times = []
for _ in range(args["repeat"]):
    t0 = time.perf_counter()
    res = tr.translate_batch(pieces, beam_size=1, max_batch_size=args["bs"], max_decoding_length=args["max_len"],
                             min_decoding_length=1)
    times.append(time.perf_counter() - t0)
print(json.dumps({"times": times, "hyps": [r.hypotheses[0] for r in res]}))
"""


class Timed:
    """Wraps a drafter, adding up the seconds spent in it (propose and observe) and counting the
    calls after which a draft head ran (it skips its work where the next call drafts nothing)."""

    def __init__(self, inner):
        self.inner, self.seconds, self.head_calls = inner, 0.0, 0
        self.name, self.max_draft = inner.name, getattr(inner, "max_draft", 0)

    def _timed(self, fn, *a):
        t0 = time.perf_counter()
        try:
            return fn(*a)
        finally:
            self.seconds += time.perf_counter() - t0

    def admit(self, *a):
        return self.inner.admit(*a)

    def select(self, *a):
        return self.inner.select(*a)

    def propose(self, *a):
        return self._timed(self.inner.propose, *a)

    def observe(self, *a):
        out = self._timed(self.inner.observe, *a)
        rows = getattr(self.inner, "rows", None)
        if getattr(self.inner, "head", None) is not None and rows is not None and bool(rows.ready.any()):
            self.head_calls += 1
        return out


def decode(tr: Translator, opts, sources: list[str], drafter=None) -> tuple[list, dict]:
    """translate_batch's work for `opts`, with the loop's counters and the drafter's time; `drafter`
    replaces the method's own."""
    method = get_method(opts.method)
    if method.drafter is None:
        t0 = time.perf_counter()
        out = tr.translate_batch(sources, opts)
        return out, {"seconds": time.perf_counter() - t0}
    ctx = tr._context(opts)
    drafter = Timed(drafter if drafter is not None else method.drafter(opts, ctx))
    reqs, cfg = [], tr.cfg
    for i, s in enumerate(sources):
        ids, _, _ = tr.prepare(s)
        if ids is not None:
            reqs.append(Request(i, ids, max(1, max_len_for(len(ids), opts.max_len_a, opts.max_len_b,
                                                           cfg.max_target_positions))))
    loop = method.loop(opts, ctx, drafter)  # its draft budget is kept across repeats, as in the API
    t0 = time.perf_counter()
    hyps = {h.index: h for h in loop.run(reqs)}
    seconds = time.perf_counter() - t0
    out = [hyps.get(i) for i in range(len(sources))]
    return out, {"seconds": seconds, "draft_seconds": drafter.seconds, "calls": loop.counters.calls,
                 "head_calls": drafter.head_calls, "fed": loop.counters.fed,
                 "row_calls": sum(h.stats.iterations for h in hyps.values())}


def text_of(tr: Translator, h) -> str:
    if h is None:
        return ""
    return tr.bundle.tgt_tok.decode(h.tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/ende-base")
    ap.add_argument("--draft-head", default="models/ende-base-draft-head")
    ap.add_argument("--heads", default="", help="blockwise proposal heads (left out when empty)")
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "ende" / "test.tsv"))
    ap.add_argument("--batch-sizes", default="1,8,64,128")
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--bs1-limit", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--methods", default="greedy,beam5,gad,gad-max,gad++-b3-t1,gad++-b5-t3")
    ap.add_argument("--ct2", action="store_true")
    ap.add_argument("--out", default="bench/results/gad.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tr = Translator.load(args.model)
    k, head = args.block_size, args.draft_head
    table = {"greedy": decode_options("greedy"), "beam5": decode_options("beam", beam=5),
             "gad": decode_options("gad", drafter=head, block_size=k),
             "gad-max": decode_options("gad", drafter=head, block_size=k, draft_length="max"),
             "gad++-b3-t1": decode_options("gad++", drafter=head, block_size=k, top_beta=3, tau=1.0),
             "gad++-b3-t1-max": decode_options("gad++", drafter=head, block_size=k, top_beta=3, tau=1.0,
                                               draft_length="max"),
             "gad++-b5-t3": decode_options("gad++", drafter=head, block_size=k, top_beta=5, tau=3.0)}
    if args.heads:
        table["blockwise-k4"] = decode_options("blockwise", drafter=args.heads, block_size=4)
    names = args.methods.split(",") + (["blockwise-k4"] if args.heads else [])
    src_all, ref_all = read_tsv(args.data, "en", "de")
    src_all, ref_all = src_all[: args.limit], ref_all[: args.limit]
    tr.translate_batch(src_all[:16], max_batch_size=16)  # warm-up
    if args.ct2:
        work = Path(tempfile.mkdtemp(prefix="gad-bench-"))
        ct2_dir = export_ct2(save_fairseq(Path(args.model), work / "fs"), work)
        sp = tr.bundle.tgt_tok.sp
    results = {"model": args.model, "draft_head": head, "machine": machine("cpu"), "threads": args.threads,
               "torch": torch.__version__, "runs": []}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        n = args.bs1_limit if bs == 1 else len(src_all)
        src, ref = src_all[:n], ref_all[:n]
        times: dict[str, list[float]] = {m: [] for m in names}
        last: dict[str, tuple] = {}
        for _ in range(args.repeat):
            for m in names:
                opts = dataclasses.replace(table[m], max_batch_size=bs)
                out, info = decode(tr, opts, src)
                times[m].append(info["seconds"])
                last[m] = (out, info)
        greedy_tok = [h.tokens if h is not None else None for h in last["greedy"][0]] if "greedy" in last else None
        for m in names:
            out, info = last[m]
            hyps = [h.text for h in out] if m == "beam5" else [text_of(tr, h) for h in out]
            secs = statistics.median(times[m])
            run = {"method": m, "batch_size": bs, "sentences": n, "seconds": secs, "seconds_all": times[m],
                   "sentences_per_s": n / secs, "bleu": BLEU.corpus_score(hyps, [ref]).score,
                   "chrf": CHRF.corpus_score(hyps, [ref]).score}
            if m != "beam5":
                toks = sum(len(h.tokens) + 1 for h in out if h is not None)
                run["tokens_per_call"] = toks / info["calls"]
                run["model_calls_per_output_token"] = (info["calls"] + info.get("head_calls", 0)) / toks
                run["draft_share"] = info["draft_seconds"] / secs
                run["identical_to_greedy"] = statistics.mean(
                    (h.tokens if h is not None else None) == g for h, g in zip(out, greedy_tok))
            results["runs"].append(run)
            print(json.dumps({k_: round(v, 4) if isinstance(v, float) else v for k_, v in run.items()
                              if k_ != "seconds_all"}), flush=True)
        if args.ct2:
            pieces = [tr.bundle.src_tok.sp.encode(tr.prepare(s)[2], out_type=str) for s in src]
            pfile = work / f"pieces-{bs}.json"
            pfile.write_text(json.dumps(pieces))
            max_len = max(max_len_for(len(p) + 1, 1.5, 10, tr.cfg.max_target_positions) for p in pieces) + 1
            for ctype in ("float32", "int8"):
                child = subprocess.run([sys.executable, "-c", CT2_CHILD, json.dumps(
                    {"pieces": str(pfile), "model": str(ct2_dir), "compute_type": ctype, "threads": args.threads,
                     "bs": bs, "repeat": args.repeat, "max_len": max_len})], capture_output=True, text=True, check=True)
                res = json.loads(child.stdout.strip().splitlines()[-1])
                hyps = [sp.decode_pieces(h) for h in res["hyps"]]
                ids = [[sp.piece_to_id(p) for p in h] for h in res["hyps"]]
                secs = statistics.median(res["times"])
                run = {"method": f"ctranslate2-{ctype}", "batch_size": bs, "sentences": n, "seconds": secs,
                       "seconds_all": res["times"], "sentences_per_s": n / secs,
                       "bleu": BLEU.corpus_score(hyps, [ref]).score, "chrf": CHRF.corpus_score(hyps, [ref]).score,
                       "identical_to_greedy": statistics.mean(a == b for a, b in zip(ids, greedy_tok))}
                results["runs"].append(run)
                print(json.dumps({k_: round(v, 4) if isinstance(v, float) else v for k_, v in run.items()
                                  if k_ != "seconds_all"}), flush=True)
    results["sacrebleu"] = {"bleu": str(BLEU.get_signature()), "chrf": str(CHRF.get_signature())}
    by = {(r["method"], r["batch_size"]): r for r in results["runs"]}
    for r in results["runs"]:
        g = by.get(("greedy", r["batch_size"]))
        if g:
            r["x_greedy"] = r["sentences_per_s"] / g["sentences_per_s"]
    print("\nmethod | bs | sent/s | x greedy | tok/call | BLEU | identical")
    for r in results["runs"]:
        print(f"{r['method']} | {r['batch_size']} | {r['sentences_per_s']:.1f} | {r.get('x_greedy', 0):.2f} | "
              f"{r.get('tokens_per_call', 0):.2f} | {r['bleu']:.2f} | {r.get('identical_to_greedy', float('nan')):.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    sys.exit(main())
