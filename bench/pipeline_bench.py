"""Pipeline overhead benchmark: in-process decoding vs the Ray corpus job (1 and 2 actors).

    python bench/pipeline_bench.py                      # models/gec-base on ../shared/data/gec/test-parquet
    python bench/pipeline_bench.py --model DIR --input PARQUET_DIR --limit 500 --out /tmp/pipeline.json

Measures, on the same sentences and DecodeOptions:
  in_process: Translator.load (model load), a warm-up batch, then one translate_batch over all rows
              with torch threads = the actor's threads (what one actor would do, minus Ray).
  ray_init:   starting the embedded local Ray (separately).
  actor_ready: starting one DecodeWorker actor by hand until its first 1-row call returns (process
              start, imports, model load): what each pipeline run pays per actor before decoding.
  pipeline:   jobs.run.run_job wall time per actor count (Read -> Decode actors -> commit), each into
              a fresh output dir; "excl_actor_start" subtracts actor_ready. A warm-up job on one
              shard runs first so Ray's worker processes are warm.
Repetitions (--repeat) interleave in-process and pipeline runs; the JSON has every run and the
medians. Ratios: efficiency = in-process decode time / pipeline time per layout (the default
layout is actors = 0), and pipeline(1 actor) / pipeline(2 actors).
Writes JSON to bench/results/pipeline.json (or --out). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def shown(path: str) -> str:
    """`path` as the JSON records it: relative to the repository or its parent, else its name."""
    p = Path(path).resolve()
    for base, prefix in ((REPO, ""), (REPO.parent, "../")):
        if p.is_relative_to(base):
            return prefix + str(p.relative_to(base))
    return p.name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "gec-base"))
    ap.add_argument("--input", default=str(REPO.parent / "shared" / "data" / "gec" / "test-parquet"))
    ap.add_argument("--text-column", default="src")
    ap.add_argument("--id-column", default="id", help="Row id column ('' for generated ids).")
    ap.add_argument("--method", default="iad")
    ap.add_argument("--limit", type=int, default=0, help="Use only the first N rows of each shard (0: all).")
    ap.add_argument("--actors", default="1,2,0", help="Actor counts to run, comma-separated (0: the default layout).")
    ap.add_argument("--rows-per-task", type=int, default=4096)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="Interleaved repetitions; medians are reported.")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs of the embedded Ray (default: all).")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "pipeline.json"))
    args = ap.parse_args(argv)

    if not (Path(args.model) / "config.json").is_file():
        print(f"skip: no model at {args.model}", file=sys.stderr)
        return 0
    if not Path(args.input).exists():
        print(f"skip: no input at {args.input}", file=sys.stderr)
        return 0
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import pyarrow.parquet as pq
    import torch

    from aggdec.api import Translator, summarize
    from aggdec.checkpoint import file_sha
    from cluster.connection import alive_nodes, connect, disconnect
    from cluster.resources import plan_actors
    from jobs.run import run_job
    from jobs.spec import load_spec

    work = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    try:
        src_dir = work / "input"
        src_dir.mkdir()
        texts: list[str] = []
        for f in sorted(Path(args.input).glob("*.parquet")):
            table = pq.read_table(f)
            if args.limit:
                table = table.slice(0, args.limit)
            pq.write_table(table, src_dir / f.name)
            texts += table.column(args.text_column).to_pylist()

        def spec_for(out: str, actors: int, inp: Path = src_dir):
            return load_spec(None, [f"model={args.model}", f"input.path={inp}", f"output.dir={out}",
                                    f"input.text_column={args.text_column}", f"decode.method={args.method}",
                                    *([f"input.id_column={args.id_column}"] if args.id_column else []),
                                    f"batching.rows_per_task={args.rows_per_task}",
                                    f"decode.max_batch_size={args.max_batch_size}", f"resources.actors={actors}"])

        actor_counts = [int(a) for a in args.actors.split(",")]
        conn = connect(None, num_cpus=args.num_cpus, log_to_driver=False)
        sha = file_sha(Path(args.model) / "model.safetensors")
        result: dict = {"model": shown(args.model), "model_sha": sha, "input": shown(args.input), "rows": len(texts),
                        "method": args.method,
                        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                 "torch": torch.__version__},
                        "ray_init_s": round(conn.seconds, 3), "cluster": conn.resources}
        try:
            plans = {n: plan_actors(alive_nodes(), actors=n) for n in actor_counts}
            threads = plans[1].torch_threads if 1 in plans else plans[actor_counts[0]].torch_threads

            # in-process, same threads as one actor
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            tr = Translator.load(args.model)
            load_s = time.perf_counter() - t0
            opts = spec_for(str(work / "x"), 1).decode
            tr.translate_batch(texts[:32], opts)  # warm-up

            def in_process() -> tuple[float, list]:
                t0 = time.perf_counter()
                out = tr.translate_batch(texts, opts)
                return time.perf_counter() - t0, out

            # one decode actor started by hand: process start + imports + model load + a 1-row call
            import numpy as np
            import ray

            from cluster.actors import DecodeWorker

            t0 = time.perf_counter()
            probe = ray.remote(DecodeWorker).options(num_cpus=plans[actor_counts[0]].num_cpus).remote(
                args.model, opts, _one_row, torch_threads=threads)
            ray.get(probe.__call__.remote({"src": np.array(["Hello ."], dtype=object)}))
            actor_ready_s = time.perf_counter() - t0
            ray.kill(probe)
            result["actor_ready_s"] = round(actor_ready_s, 3)
            print(f"actor start + model load + 1 row: {actor_ready_s:.2f}s")

            # warm-up job on one shard (Ray workers, imports)
            first = sorted(src_dir.glob("*.parquet"))[0]
            run_job(spec_for(str(work / "warmup"), 1, inp=first))

            # Interleave repetitions (in-process, then each layout) so that drifts of a noisy machine
            # hit every variant alike; report medians.
            walls: dict[int, list[float]] = {n: [] for n in actor_counts}
            decode_times: list[float] = []
            jobs: dict[int, tuple] = {}
            for rep in range(args.repeat):
                seconds, res = in_process()
                decode_times.append(seconds)
                print(f"[{rep + 1}/{args.repeat}] in-process: {decode_times[-1]:.2f}s ({len(texts) / decode_times[-1]:.1f} sent/s)")
                for n in actor_counts:
                    out = work / f"out-{n}-{rep}"
                    t0 = time.perf_counter()
                    job = run_job(spec_for(str(out), n))
                    walls[n].append(time.perf_counter() - t0)
                    jobs[n] = (job, out)
                    label = f"default layout ({plans[n].actors} actors x {plans[n].torch_threads} threads)" if n == 0 else f"{n} actor(s)"
                    print(f"[{rep + 1}/{args.repeat}] pipeline {label}: {walls[n][-1]:.2f}s "
                          f"({len(texts) / walls[n][-1]:.1f} sent/s)")
            decode_s = statistics.median(decode_times)
            summary = summarize(res, decode_s)
            result["in_process"] = {"torch_threads": threads, "model_load_s": round(load_s, 3),
                                    "decode_s": round(decode_s, 3), "decode_s_runs": [round(t, 3) for t in decode_times],
                                    "sentences_per_s": round(summary["sentences_per_s"], 2),
                                    "tokens_per_iter": round(summary["tokens_per_iter"], 3)}
            result["pipeline"] = {}
            for n in actor_counts:
                job, out = jobs[n]
                wall = statistics.median(walls[n])
                manifest = json.loads((out / "_manifest.json").read_text())
                result["pipeline"][str(n)] = {
                    "actors": plans[n].actors, "torch_threads": plans[n].torch_threads, "num_cpus_per_actor": plans[n].num_cpus,
                    "wall_s": round(wall, 3), "wall_s_runs": [round(t, 3) for t in walls[n]],
                    "pipeline_s": job.pipeline_seconds,
                    "excl_actor_start_s": round(wall - actor_ready_s, 3),
                    "sentences_per_s": round(len(texts) / wall, 2),
                    "engine_decode_s_summed": round(manifest["totals"]["speedup"]["decode_ms"] / 1000, 3),
                    "rows": job.rows, "ok": job.ok, "errors": job.errors,
                    "same_output_as_in_process": _same(out, res)}
        finally:
            disconnect(conn)

        if file_sha(Path(args.model) / "model.safetensors") != sha:
            result["warning"] = "the model file changed during the benchmark (training still writing it?)"
            print(result["warning"], file=sys.stderr)
        p1 = result["pipeline"].get("1")
        ratios = {}
        if p1:
            ratios["pipeline_1actor_over_in_process"] = round(p1["wall_s"] / result["in_process"]["decode_s"], 3)
            ratios["pipeline_1actor_excl_actor_start_over_in_process"] = round(
                p1["excl_actor_start_s"] / result["in_process"]["decode_s"], 3)
        if p1 and "2" in result["pipeline"]:
            ratios["speedup_2_actors_over_1"] = round(p1["wall_s"] / result["pipeline"]["2"]["wall_s"], 3)
        for n, p in result["pipeline"].items():  # the efficiency: in-process decode / pipeline time
            name = "default" if n == "0" else f"{n}_actors"
            ratios[f"efficiency_{name}"] = round(result["in_process"]["decode_s"] / p["wall_s"], 3)
            ratios[f"efficiency_{name}_excl_actor_start"] = round(result["in_process"]["decode_s"] / p["excl_actor_start_s"], 3)
        result["ratios"] = ratios
        print(json.dumps(ratios, indent=2))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _one_row(translator, options, batch):
    """A decode actor task for the start-up probe: decode the batch's `src` rows."""
    import pyarrow as pa

    return pa.table({"hyp": [r.text for r in translator.translate_batch(list(batch["src"]), options)]})


def _same(out: Path, reference) -> float:
    """Fraction of rows whose pipeline hypothesis equals the in-process one (same row order)."""
    import pyarrow.parquet as pq

    hyps: list[str] = []
    for f in sorted(out.glob("*.parquet")):
        hyps += pq.read_table(f, columns=["hyp"]).column("hyp").to_pylist()
    same = sum(h == r.text for h, r in zip(hyps, reference))
    return round(same / max(1, len(reference)), 4)


if __name__ == "__main__":
    sys.exit(main())
