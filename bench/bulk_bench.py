"""Bulk throughput, best against best: our greedy and IAD (or GAD) at each verifier precision against
CTranslate2 float32 and int8 on the same weights, every system and batch size in its own process.

    python bench/bulk_bench.py --model models/gec-base --data ../shared/data/gec/test.tsv \
        --column noisy --ref-column clean --batch-sizes 1,8,32,64,128,256 --repeat 3 \
        --out bench/results/bulk-gec.json

Systems (`--systems`): `METHOD@PRECISION` for aggdec (METHOD greedy, iad, gad, beam; PRECISION fp32,
bf16, int8), `ct2@COMPUTE` (CTranslate2 greedy; float32, int8, int8_float32) and `ct2-beam@COMPUTE`
(CTranslate2 beam search; `--beam` sets both beams, default 5). Each (system, batch size) runs in a fresh
process (two OpenMP runtimes in one process slow each other down), repeats interleaved; reported:
median sentences/s, share of outputs identical to our fp32 greedy's, BLEU and chrF against the
references, ERRANT F0.5 for gec (`--errant`), and each system's best batch size. IAD runs with a
16-token draft cap and both re-alignment fallbacks (`--iad-options`); GAD with `--drafter`. A
system whose process fails (CTranslate2 refuses a compute type the CPU lacks) gets an `error` row
and is not run again; the others run, and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from aggdec.api import Translator
from aggdec.evaluate import bleu_chrf, gec_scores
from aggdec.train.ar import read_tsv

HERE = Path(__file__).resolve()
CT2 = ("ct2@", "ct2-beam@")  # CTranslate2 systems: greedy, beam search


def worker(a: argparse.Namespace) -> None:
    """Decode the sentences of `a.data` with one system at one batch size; write texts and seconds."""
    torch.set_num_threads(a.threads)
    sents = read_tsv(a.data, a.column, a.column)[0][: a.limit]
    system, bs = a.worker, a.batch_size
    if system.startswith(CT2):
        import ctranslate2

        from baseline_bench import export_ct2

        tr = Translator.load(a.model)
        sp = tr.bundle.src_tok.sp
        pieces = [sp.id_to_piece(tr.prepare(s)[0][:-1]) for s in sents]
        ct2 = ctranslate2.Translator(str(export_ct2(Path(a.export), Path(a.export).parent)), device="cpu",
                                     compute_type=system.split("@")[1], inter_threads=1, intra_threads=a.threads)
        beam = a.beam if system.startswith("ct2-beam@") else 1
        run = lambda xs: ct2.translate_batch(xs, beam_size=beam, max_batch_size=bs,  # noqa: E731
                                             max_decoding_length=256, min_decoding_length=1)
        run(pieces[:8])
        t0 = time.perf_counter()
        res = run(pieces)
        secs = time.perf_counter() - t0
        texts = [tr.bundle.tgt_tok.decode([sp.piece_to_id(p) for p in r.hypotheses[0]]) for r in res]
    else:
        method, precision = system.split("@")
        tr = Translator.load(a.model)
        extra = (json.loads(a.iad_options) if method == "iad" else {"beam": a.beam} if method == "beam"
                 else {"drafter": a.drafter} if method != "greedy" else {})
        kw = dict(method=method, max_batch_size=bs, precision=precision, **extra)
        tr.translate_batch(sents[:16], **kw)  # warm-up: conversion, packing, the draft budget's first estimates
        t0 = time.perf_counter()
        res = tr.translate_batch(sents, **kw)
        secs = time.perf_counter() - t0
        texts = [r.text for r in res]
    Path(a.result).write_text(json.dumps({"seconds": secs, "texts": texts}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/gec-base")
    ap.add_argument("--data", default="../shared/data/gec/test.tsv")
    ap.add_argument("--column", default="noisy")
    ap.add_argument("--ref-column", default="clean")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--bs1-limit", type=int, default=300, help="sentences for batch 1 (default 300)")
    ap.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    ap.add_argument("--systems", default="greedy@fp32,greedy@bf16,greedy@int8,iad@fp32,iad@bf16,iad@int8,"
                                         "ct2@float32,ct2@int8")
    ap.add_argument("--iad-options", default='{"draft_cap": 16, "substitution": true, "nearest_match": true}')
    ap.add_argument("--drafter", default=None, help="draft head for gad systems")
    ap.add_argument("--beam", type=int, default=5, help="beam size of beam@... and ct2-beam@... systems")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--errant", action="store_true", help="ERRANT F0.5 against the references (gec)")
    ap.add_argument("--out", default="bench/results/bulk-gec.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--export", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    sys.path.insert(0, str(HERE.parent))
    from baseline_bench import machine

    from aggdec.fairseq_io import save_fairseq
    from aggdec.model.precision import cpu_isa

    srcs, refs = read_tsv(a.data, a.column, a.ref_column)
    srcs, refs = srcs[: a.limit], refs[: a.limit]
    work = Path(tempfile.mkdtemp(prefix="aggdec-bulk-"))
    export = save_fairseq(a.model, work / "fairseq") if any(s.startswith(CT2) for s in a.systems.split(",")) else work
    systems, sizes = a.systems.split(","), [int(b) for b in a.batch_sizes.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    texts: dict[tuple[str, int], list[str]] = {}
    failed: dict[tuple[str, int], int] = {}  # (system, batch size) -> the worker's exit status
    for rep in range(a.repeat):
        for bs in sizes:
            n = min(a.bs1_limit, len(srcs)) if bs == 1 else len(srcs)
            for system in systems:
                if (system, bs) in failed:
                    continue
                out = work / "result.json"
                cmd = [sys.executable, str(HERE), "--worker", system, "--batch-size", str(bs), "--result", str(out),
                       "--model", a.model, "--data", a.data, "--column", a.column, "--limit", str(n),
                       "--threads", str(a.threads), "--iad-options", a.iad_options, "--export", str(export),
                       "--beam", str(a.beam)]
                if a.drafter:
                    cmd += ["--drafter", a.drafter]
                status = subprocess.run(cmd).returncode  # a system that fails leaves an error row; the others run
                if status:
                    failed[(system, bs)] = status
                    print(f"rep {rep} {system} bs {bs}: failed (exit {status})", flush=True)
                    continue
                r = json.loads(out.read_text())
                times.setdefault((system, bs), []).append(n / r["seconds"])
                texts[(system, bs)] = r["texts"]
                print(f"rep {rep} {system} bs {bs}: {n / r['seconds']:.1f} sent/s", flush=True)
    ref_sys = ("greedy@fp32", max(sizes))
    runs = []
    f05: dict[tuple[str, ...], float] = {}  # ERRANT once per distinct output (most systems share theirs)
    for (system, bs), speeds in times.items():
        hyps = texts[(system, bs)]
        n = len(hyps)
        base = texts.get(ref_sys)  # None where greedy@fp32 did not run
        run = {"system": system, "batch_size": bs, "sentences": n, "sentences_per_s": statistics.median(speeds),
               "all_sentences_per_s": speeds,
               "identical_to_fp32_greedy": None if base is None else sum(h == g for h, g in zip(hyps, base)) / n}
        run.update({k: v for k, v in bleu_chrf(hyps, refs[:n]).items() if k in ("bleu", "chrf", "bleu_signature")})
        if a.errant and bs != 1:
            key = tuple(hyps)
            if key not in f05:
                f05[key] = gec_scores(srcs[:n], hyps, refs[:n])["f0.5"]
            run["f0.5"] = f05[key]
        runs.append(run)
    runs += [{"system": system, "batch_size": bs, "error": f"the worker exited with status {status}"}
             for (system, bs), status in failed.items()]
    best = {}
    for run in runs:
        if "error" not in run and (run["batch_size"] != 1 or len(sizes) == 1):
            b = best.get(run["system"])
            if b is None or run["sentences_per_s"] > b["sentences_per_s"]:
                best[run["system"]] = run
    result = {"model": a.model, "data": a.data, "threads": a.threads, "machine": machine("cpu"), "cpu_isa": cpu_isa(),
              "torch": torch.__version__,
              "iad_options": json.loads(a.iad_options), "beam": a.beam, "repeat": a.repeat, "runs": runs,
              "best": {s: {"batch_size": r["batch_size"], "sentences_per_s": r["sentences_per_s"]} for s, r in best.items()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    for run in sorted(runs, key=lambda r: (r["batch_size"], r["system"])):
        if "error" in run:
            print(f"bs {run['batch_size']:>3} {run['system']:<16} {run['error']}")
            continue
        same = run["identical_to_fp32_greedy"]
        print(f"bs {run['batch_size']:>3} {run['system']:<16} {run['sentences_per_s']:8.1f} sent/s  "
              f"identical {'-' if same is None else f'{same:.3f}'}  BLEU {run['bleu']:.2f}")
    print("best:", json.dumps(result["best"]))
    print(f"wrote {a.out}")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
