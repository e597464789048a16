"""`gpu`: the decode engine on one GPU, section by section, each written as soon as it is measured.

- environment: the device, torch and CUDA, the attention backends and matmul precision settings;
- shipped models (`gec-base`: greedy, IAD; `ende-base`: greedy, GAD with the draft head, blockwise
  with the proposal heads, beam-5; `ende-base-double-token`: greedy), through the public API, at
  fp32 and bf16, with the batch-invariant kernels and without (`--invariant`), and each batch size:
  sentences/s, the identical share against batch-1 greedy of the same
  precision (over its first `--bs1-limit` sentences) and against greedy at the same
  precision on the same device, against fp32 greedy on the CPU where the device is a GPU (another
  device may round differently), the CUDA graphs the run's slot loop holds and how many it captured
  after its warm-up (must be none), peak memory;
- transformers `generate` against aggdec greedy on the OPUS-MT-shaped Marian model (random weights,
  `compare`'s systems and processes) on the same device;
- `cluster.actors.DecodeWorker` on the device over one Parquet shard, called directly (no Ray):
  sentences/s and the identical share against the API's output.

`--device cpu --quick` runs every section on a few sentences, to prove the command before a GPU is lent.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench.record import REPO, Results, shown

SHIPPED = (  # model, which data, methods
    ("gec-base", "gec", ("greedy", "iad")),
    ("ende-base", "ende", ("greedy", "gad", "blockwise", "beam")),
    ("ende-base-double-token", "ende", ("greedy",)),
)
OPTIONS = {"gad": {"drafter": str(REPO / "models" / "ende-base-draft-head")},
           "blockwise": {"drafter": str(REPO / "models" / "ende-base-heads")}, "beam": {"beam": 5}}
COLUMNS = {"gec": "noisy", "ende": "en"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gec-data", type=Path, required=True, help="a TSV with a `noisy` column (gec/test.tsv)")
    ap.add_argument("--ende-data", type=Path, required=True, help="a TSV with an `en` column (ende/test.tsv)")
    ap.add_argument("--shard", type=Path, required=True, help="a Parquet file with a `src` column (DecodeWorker)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--bs1-limit", type=int, default=200)
    ap.add_argument("--batch-sizes", default="1,64,256,1024")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--invariant", default="auto,false",
                    help="the `invariant` settings of lossless methods, each a run (auto: on for them on a GPU)")
    ap.add_argument("--quick", action="store_true", help="a few sentences at batch sizes 1 and 4: a smoke run")
    ap.add_argument("--out", type=Path, default=None)


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"section": "environment", "torch": torch.__version__, "device": device}
    if device.startswith("cuda"):
        env.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(),
                   flash_sdp=torch.backends.cuda.flash_sdp_enabled(),
                   mem_efficient_sdp=torch.backends.cuda.mem_efficient_sdp_enabled(),
                   math_sdp=torch.backends.cuda.math_sdp_enabled(),
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    env["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    return env


def graphs(tr) -> int:
    """CUDA graphs the translator's slot loops captured (failed captures not counted)."""
    return sum(loop.counters.captures for loop in tr._slot_loops.values())


def capture_failures(tr) -> int:
    """Captures that failed in the translator's slot loops (those steps ran eagerly)."""
    return sum(loop.counters.capture_failures for loop in tr._slot_loops.values())


def shipped(results: Results, a: argparse.Namespace, sizes: list[int]) -> None:
    import torch

    from aggdec.api import Translator, decode_options
    from aggdec.train.ar import read_tsv

    on_gpu = a.device.startswith("cuda")
    invariants = [{"true": True, "false": False}.get(v, v) for v in a.invariant.split(",")]
    for name, data, methods in SHIPPED:
        path = REPO / "models" / name
        texts = read_tsv(a.gec_data if data == "gec" else a.ende_data, COLUMNS[data], COLUMNS[data])[0][: a.limit]
        tr = Translator.load(path, device=a.device)
        cpu = [r.tokens for r in Translator.load(path).translate_batch(texts, max_batch_size=64)] if on_gpu else None
        for precision, invariant in ((p, i) for p in a.precisions.split(",") for i in invariants):
            # batch-1 greedy of this model at this precision: the output every method and batch size must give
            one = [r.tokens for r in tr.translate_batch(texts[: a.bs1_limit], decode_options(
                "greedy", max_batch_size=1, precision=precision, invariant=invariant))]
            for bs in sizes:
                n = min(a.bs1_limit, len(texts)) if bs == 1 else len(texts)
                greedy = None
                for method in methods:
                    if method == "beam" and invariant != invariants[0]:
                        continue  # beam has no invariant kernels: once
                    run = {"section": "shipped", "model": name, "method": method, "precision": precision,
                           "invariant": None if method == "beam" else invariant, "batch_size": bs, "sentences": n}
                    try:
                        kw = {} if method == "beam" else {"invariant": invariant}
                        opts = decode_options(method, max_batch_size=bs, precision=precision, **kw,
                                              **OPTIONS.get(method, {}))
                        tr.translate_batch(texts[: min(n, 2 * bs)], opts)  # warm-up: captures
                        before = graphs(tr)
                        if on_gpu:
                            torch.cuda.reset_peak_memory_stats()
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        res = tr.translate_batch(texts[:n], opts)
                        if on_gpu:
                            torch.cuda.synchronize()
                        seconds = time.perf_counter() - t0
                        tokens = [r.tokens for r in res]
                        greedy = tokens if method == "greedy" else greedy
                        run.update(sentences_per_s=round(n / seconds, 1),
                                   tokens_per_s=round(sum(len(t) + 1 for t in tokens) / seconds, 1),
                                   graphs=graphs(tr), captures_after_warm_up=graphs(tr) - before,
                                   capture_failures=capture_failures(tr))
                        if method != "beam" and greedy is not None:
                            run["identical_to_greedy"] = round(sum(x == y for x, y in zip(tokens, greedy)) / n, 4)
                        if method != "beam":
                            run["identical_to_bs1_greedy"] = round(sum(x == y for x, y in zip(tokens, one)) / len(one), 4)
                        if cpu is not None and precision == "fp32" and method != "beam":
                            run["identical_to_cpu_greedy"] = round(sum(x == y for x, y in zip(tokens, cpu)) / n, 4)
                        if on_gpu:
                            run["peak_memory_mb"] = round(torch.cuda.max_memory_allocated() / 2**20)
                    except Exception as e:  # one failing method leaves its error; the others run
                        run["error"] = f"{type(e).__name__}: {e}"[:500]
                    results.add(run)


def transformers_section(results: Results, a: argparse.Namespace, sizes: list[int]) -> None:
    """transformers `generate` and aggdec greedy in processes of their own (`compare`'s)."""
    from bench import compare

    ap = argparse.ArgumentParser()
    compare.add_arguments(ap, "greedy,transformers")
    limit, bs1, new = (4, 2, 8) if a.quick else (512, 32, 32)
    ns = ap.parse_args(["--model", "opus-mt-shaped", "--data", str(a.ende_data), "--column", "en",
                        "--systems", "greedy,transformers", "--reference", "transformers", "--max-new", str(new),
                        "--batch-sizes", ",".join(str(b) for b in sizes if b <= 64), "--limit", str(limit),
                        "--bs1-limit", str(bs1), "--repeat", "1", "--device", a.device])
    for run in compare.measure(ns):
        results.add({"section": "transformers", **run})


def decode_worker(results: Results, a: argparse.Namespace) -> None:
    """DecodeWorker on the device, called directly over one shard, against the API's output."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from aggdec.api import Translator, decode_options
    from bench.pipeline import decode_rows
    from cluster.actors import DecodeWorker

    texts = pq.read_table(a.shard, columns=["src"]).column("src").to_pylist()[: a.limit]
    opts = decode_options("iad", max_batch_size=64)
    model = str(REPO / "models" / "gec-base")
    run: dict[str, Any] = {"section": "decode_worker", "model": "gec-base", "method": "iad", "batch_size": 64,
                           "sentences": len(texts)}
    try:
        worker = DecodeWorker(model, opts, decode_rows, device=a.device, torch_threads=torch.get_num_threads())
        worker({"src": np.array(texts[:64], dtype=object)})  # warm-up
        t0 = time.perf_counter()
        hyps = worker({"src": np.array(texts, dtype=object)}).column("hyp").to_pylist()
        seconds = time.perf_counter() - t0
        want = [r.text for r in Translator.load(model, device=a.device).translate_batch(texts, opts)]
        run.update(sentences_per_s=round(len(texts) / seconds, 1),
                   identical_to_api=round(sum(x == y for x, y in zip(hyps, want)) / len(texts), 4))
    except Exception as e:
        run["error"] = f"{type(e).__name__}: {e}"[:500]
    results.add(run)


def main(a: argparse.Namespace) -> int:
    if a.quick:
        a.limit, a.bs1_limit, a.batch_sizes = 16, 4, "1,4"
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    settings = {k: shown(str(v)) if isinstance(v, Path) else v for k, v in vars(a).items()
                if k not in ("out", "func", "command")}
    results = Results(a.out, "gpu", settings, a.device)
    results.add(environment(a.device))
    shipped(results, a, sizes)
    transformers_section(results, a, sizes)
    decode_worker(results, a)
    # lossless runs that must be greedy's: all but those without the invariant kernels (GAD++ is not run)
    bad = [r for r in results.runs if r.get("captures_after_warm_up") or (r.get("invariant") is not False and min(
        r.get("identical_to_greedy", 1), r.get("identical_to_bs1_greedy", 1)) < 1)]
    return 1 if results.failed or bad else 0
