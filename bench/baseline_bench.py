"""Baselines on one model, one run, side by side: our greedy and beam-5 (batch 1 and 64) versus
fairseq-generate and CTranslate2 greedy on exactly the same weights (exported with
`aggdec convert --to fairseq`). CPU, decode time only (model loading excluded for every system).

    python bench/baseline_bench.py --model models/gec-base --data ../shared/data/gec/test.tsv \
        --column noisy --out bench/results/baseline-gec.json

Needs fairseq-fixed and ctranslate2 installed (each is skipped with a note when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from aggdec.api import Translator
from aggdec.decoding.beam import beam_search
from aggdec.decoding.limits import max_len_for
from aggdec.decoding.loop import DraftVerifyLoop
from aggdec.decoding.metadata import Request
from aggdec.fairseq_io import save_fairseq
from aggdec.train.ar import read_tsv

MAX_LEN_A, MAX_LEN_B = 1.5, 10


def machine(device: str) -> str:
    """What a benchmark ran on: the GPU's name for cuda, else the CPU's."""
    return torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or platform.machine()


def add_run_args(ap: argparse.ArgumentParser, batch_sizes: str) -> None:
    """Options shared by the side-by-side decoding benchmarks: which sentences, batch sizes,
    verifier precisions, threads and repeats."""
    ap.add_argument("--limit", type=int, default=None, help="first N sentences (default: all)")
    ap.add_argument("--bs1-limit", type=int, default=None, help="first N sentences for the batch-1 runs")
    ap.add_argument("--batch-sizes", default=batch_sizes)
    ap.add_argument("--precisions", default="fp32", help="verify_precision values to run: fp32, bf16-certified or both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="runs per method, interleaved; report the median time")


def with_precision(method: str, precision: str) -> str:
    """Run name of `method` decoded with verify_precision `precision` ("greedy", "greedy@bf16c")."""
    return method if precision == "fp32" else f"{method}@bf16c"


def greedy_like(name: str) -> str:
    """The greedy run of the same precision as run `name`."""
    return "greedy" + name[name.find("@"):] if "@" in name else "greedy"


def ours(tr: Translator, reqs: list[Request], method: str, bs: int) -> tuple[dict[int, list[int]], float]:
    t0 = time.perf_counter()
    if method == "beam":
        hyps = beam_search(tr.model, reqs, beam=5, max_batch_size=bs)
    else:
        hyps = list(DraftVerifyLoop(tr.model, max_batch_size=bs).run(reqs))
    return {h.index: h.tokens for h in hyps}, time.perf_counter() - t0


def fairseq_generate(export: Path, pieces: list[str], beam: int, bs: int, work: Path, threads: int):
    """Binarize `pieces` with the exported dictionaries and run fairseq-generate; -> ({i: ids}, seconds)."""
    raw = work / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for lang in ("src", "tgt"):
        (raw / f"test.{lang}").write_text("\n".join(pieces) + "\n", encoding="utf-8")
    bin_dir = work / "bin"
    if not (bin_dir / "test.src-tgt.src.bin").exists():
        subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "src", "--target-lang", "tgt",
                        "--testpref", str(raw / "test"), "--destdir", str(bin_dir), "--srcdict", str(export / "dict.src.txt"),
                        "--tgtdict", str(export / "dict.tgt.txt"), "--workers", "1"], check=True, capture_output=True)
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "fairseq_cli.generate", str(bin_dir), "--path", str(export / "checkpoint.pt"),
           "--source-lang", "src", "--target-lang", "tgt", "--gen-subset", "test", "--beam", str(beam), "--cpu",
           "--batch-size", str(bs), "--required-batch-size-multiple", "1", "--max-len-a", str(MAX_LEN_A),
           "--max-len-b", str(MAX_LEN_B), "--num-workers", "0"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    hyps: dict[int, list[str]] = {}
    for line in out.stdout.splitlines():
        if line.startswith("H-"):
            head, _, text = line.split("\t", 2)
            hyps[int(head[2:])] = text.split()
    m = re.search(r"Translated [\d,]+ sentences \([\d,]+ tokens\) in ([\d.]+)s", out.stdout + out.stderr)
    return hyps, float(m.group(1)) if m else float("nan")


def export_ct2(export: Path, work: Path) -> Path:
    """Convert an exported fairseq checkpoint (see `save_fairseq`) with CTranslate2's converter."""
    ct2_dir = work / "ct2"
    if not ct2_dir.exists():
        env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
        subprocess.run(["ct2-fairseq-converter", "--model_path", str(export / "checkpoint.pt"), "--data_dir", str(export),
                        "--source_lang", "src", "--target_lang", "tgt", "--output_dir", str(ct2_dir),
                        "--unsafe_deserialization"],  # our own export: a trusted pickle
                       check=True, capture_output=True, env=env)
    return ct2_dir


def ctranslate2_greedy(ct2_dir: Path, pieces: list[list[str]], bs: int, threads: int, max_len: int):
    """-> (hypotheses as pieces, decode seconds) with CTranslate2 greedy search on the CPU."""
    import ctranslate2

    tr = ctranslate2.Translator(str(ct2_dir), device="cpu", inter_threads=1, intra_threads=threads)
    t0 = time.perf_counter()
    res = tr.translate_batch(pieces, beam_size=1, max_batch_size=bs, max_decoding_length=max_len, min_decoding_length=1)
    return [r.hypotheses[0] for r in res], time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/gec-base")
    ap.add_argument("--data", default="../shared/data/gec/test.tsv")
    ap.add_argument("--column", default="noisy")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--bs1-limit", type=int, default=None, help="sentences for batch-1 runs (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default="ours,fairseq,ctranslate2")
    ap.add_argument("--out", default="bench/results/baseline.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    tr = Translator.load(a.model)
    sp = tr.bundle.src_tok.sp
    sents = [s for s in read_tsv(a.data, a.column, a.column)[0][: a.limit] if s.strip()]
    reqs, pieces = [], []
    for i, s in enumerate(sents):
        ids, _, text = tr.prepare(s)
        reqs.append(Request(i, ids, max_len_for(len(ids), MAX_LEN_A, MAX_LEN_B, tr.cfg.max_target_positions)))
        pieces.append(sp.id_to_piece(ids[:-1]))
    systems = a.systems.split(",")
    runs, ref = [], {}
    work = Path(tempfile.mkdtemp(prefix="aggdec-baseline-"))
    export = save_fairseq(a.model, work / "fairseq")
    list(DraftVerifyLoop(tr.model, max_batch_size=8).run(reqs[:8]))  # warm-up

    def record(system, method, bs, n, secs, outs: dict[int, list[int]]):
        toks = sum(len(v) + 1 for v in outs.values())
        same = [outs.get(i) == ref.get(i) for i in range(n) if i in ref]
        run = {"system": system, "method": method, "batch_size": bs, "sentences": n, "seconds": secs,
               "sentences_per_s": n / secs, "tokens_per_s": toks / secs,
               "identical_to_our_greedy": sum(same) / len(same) if same else None}
        runs.append(run)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in run.items()}), flush=True)

    for bs in (1, 64):
        n = a.bs1_limit if bs == 1 and a.bs1_limit else len(reqs)
        for method in ("greedy", "beam"):
            if "ours" in systems:
                outs, secs = ours(tr, reqs[:n], method, bs)
                if method == "greedy":
                    for i, v in outs.items():
                        ref.setdefault(i, v)
                record("aggdec", method, bs, n, secs, outs)
            if "fairseq" in systems:
                try:
                    hyp, secs = fairseq_generate(export, [" ".join(p) for p in pieces[:n]], 1 if method == "greedy" else 5,
                                                 bs, work / f"fs-{n}", a.threads)
                    record("fairseq-generate", method, bs, n, secs, {i: [sp.piece_to_id(p) for p in h] for i, h in hyp.items()})
                except (subprocess.CalledProcessError, ModuleNotFoundError) as e:
                    print(f"fairseq-generate skipped: {e}", file=sys.stderr)
                    systems.remove("fairseq")
        if "ctranslate2" in systems:
            try:
                outs, secs = ctranslate2_greedy(export_ct2(export, work), pieces[:n], bs, a.threads,
                                                max(r.max_len for r in reqs) + 1)
                record("ctranslate2", "greedy", bs, n, secs, {i: [sp.piece_to_id(p) for p in h] for i, h in enumerate(outs)})
            except (ImportError, subprocess.CalledProcessError) as e:
                print(f"ctranslate2 skipped: {e}", file=sys.stderr)
                systems.remove("ctranslate2")
    by = {(r["system"], r["method"], r["batch_size"]): r for r in runs}
    ratios = {}
    for (system, method, bs), r in by.items():
        if system != "aggdec" and ("aggdec", method, bs) in by:
            ratios[f"aggdec/{system} {method} bs{bs}"] = by[("aggdec", method, bs)]["sentences_per_s"] / r["sentences_per_s"]
    result = {"model": a.model, "sha": tr.bundle.sha, "data": a.data, "threads": a.threads, "torch": torch.__version__,
              "runs": runs, "speed_ratios": ratios}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print("ratios (sentences/s, >1 means aggdec faster):", json.dumps({k: round(v, 2) for k, v in ratios.items()}))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
