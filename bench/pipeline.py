"""`jobs`: a corpus job on a local Ray against decoding the same rows in-process.

In-process: `Translator.translate_batch` over every row with the decode options of the job and the
torch threads of one actor (what an actor does, without Ray). Jobs: `jobs.run.run_job` for each
actor layout of `--actors` (0: the default layout), each into a fresh output folder, after a
warm-up job on one shard that starts Ray's workers. Repeats interleave in-process decoding and
every layout; per layout: the median wall time, sentences/s, efficiency (in-process decoding time /
job wall time) and the share of rows whose output equals in-process decoding's (`identical`). Ray's
start-up and one actor's start (process, imports, model load, one row) are reported on their own.

`--stage`: the Ray Data stage too (jobs.stage: `read_parquet` -> `build_processor` with the job's
options and `rows_per_task` as its batch size -> `write_parquet`, the default actor pool), timed
from the read to the last row written, interleaved with the jobs. `--from-tsv`: the input is built
from a TSV column (`--rows` rows in 10 shards) instead of `--input`'s shards. `--no-in-process`:
no in-process decoding (large inputs); every output is checked against the first layout's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.record import Results, shown


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="models/gec-base")
    ap.add_argument("--input", type=Path, default=None, help="a folder of Parquet shards")
    ap.add_argument("--from-tsv", type=Path, default=None, help="build the input from this TSV instead")
    ap.add_argument("--tsv-column", default="noisy", help="--from-tsv: the text column")
    ap.add_argument("--rows", type=int, default=40000, help="--from-tsv: its first N rows")
    ap.add_argument("--stage", action="store_true", help="time the Ray Data stage (jobs.stage) too")
    ap.add_argument("--no-in-process", dest="in_process", action="store_false",
                    help="skip in-process decoding; outputs are checked against the first layout's")
    ap.add_argument("--text-column", default="src")
    ap.add_argument("--id-column", default="id")
    ap.add_argument("--method", default="iad")
    ap.add_argument("--limit", type=int, default=0, help="first N rows of each shard (0: all)")
    ap.add_argument("--actors", default="1,0", help="actor counts, comma-separated (0: the default layout)")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--rows-per-task", type=int, default=None, help="the jobs' batching.rows_per_task and the "
                                                                     "stage's batch size (default: the spec's)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    ap.add_argument("--out", type=Path, default=None)


def decode_rows(translator, options, batch):
    """A decode actor's task for the start-up probe: the batch's `src` rows decoded."""
    import pyarrow as pa

    return pa.table({"hyp": [r.text for r in translator.translate_batch(list(batch["src"]), options)]})


def hypotheses(out: Path) -> list[str]:
    import pyarrow.parquet as pq

    return [h for f in sorted(out.glob("*.parquet"))
            for h in pq.read_table(f, columns=["hyp"]).column("hyp").to_pylist()]


def tsv_shards(path: Path, column: str, rows: int, out: Path, files: int = 10) -> None:
    """The first `rows` rows of `path`'s `column` as `files` Parquet shards (columns id, src) in `out`."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    table = pcsv.read_csv(path, parse_options=pcsv.ParseOptions(delimiter="\t", quote_char=False)).slice(0, rows)
    per = -(-table.num_rows // files)
    out.mkdir(parents=True)
    for k in range(files):
        part = table.slice(k * per, per)
        pq.write_table(pa.table({"id": [f"row-{k * per + i}" for i in range(part.num_rows)],
                                 "src": part.column(column)}), out / f"part-{k:05d}.parquet")


def main(a: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import numpy as np
    import pyarrow.parquet as pq
    import ray
    import ray.data
    import torch

    from aggdec.api import Translator
    from cluster.actors import DecodeWorker
    from cluster.connection import alive_nodes, connect, disconnect
    from cluster.resources import plan_actors
    from jobs import build_processor
    from jobs.run import run_job
    from jobs.spec import load_spec

    settings = {k: shown(str(v)) if isinstance(v, Path) else v for k, v in vars(a).items()
                if k not in ("out", "func", "command")}
    results = Results(a.out, "jobs", settings)
    work = Path(tempfile.mkdtemp(prefix="aggdec-bench-jobs-"))
    try:
        if (a.input is None) == (a.from_tsv is None):
            raise ValueError("give one of --input and --from-tsv")
        if a.from_tsv is not None:
            a.input = work / "tsv"
            tsv_shards(a.from_tsv, a.tsv_column, a.rows, a.input)
        shards = sorted(a.input.glob("*.parquet"))
        if not shards:
            raise ValueError(f"{a.input}: no Parquet shards")
        source, texts = work / "input", []
        source.mkdir()
        for f in shards:  # the rows decoded, in the order the job's outputs list them
            table = pq.read_table(f)
            table = table.slice(0, a.limit) if a.limit else table
            pq.write_table(table, source / f.name)
            texts += table.column(a.text_column).to_pylist()

        def spec(out: Path, actors: int, inp: Path = source):
            return load_spec(None, [f"model={a.model}", f"input.path={inp}", f"output.dir={out}",
                                    f"input.text_column={a.text_column}", f"input.id_column={a.id_column}",
                                    f"decode.method={a.method}", f"decode.max_batch_size={a.max_batch_size}",
                                    f"resources.actors={actors}",
                                    *([f"batching.rows_per_task={a.rows_per_task}"] if a.rows_per_task else [])])

        counts = [int(n) for n in a.actors.split(",")]
        conn = connect(None, num_cpus=a.num_cpus, log_to_driver=False)
        results.add({"layout": "ray start", "wall_s": round(conn.seconds, 3)})
        try:
            plans = {n: plan_actors(alive_nodes(), actors=n) for n in counts}
            threads = plans[counts[0]].torch_threads
            torch.set_num_threads(threads)
            tr = Translator.load(a.model)
            opts = spec(work / "x", 1).decode
            tr.translate_batch(texts[:32], opts)  # warm-up
            t0 = time.perf_counter()
            probe = ray.remote(DecodeWorker).options(num_cpus=plans[counts[0]].num_cpus).remote(
                a.model, opts, decode_rows, torch_threads=threads)
            ray.get(probe.__call__.remote({"src": np.array(["Hello ."], dtype=object)}))
            results.add({"layout": "one actor's start", "wall_s": round(time.perf_counter() - t0, 3)})
            ray.kill(probe)
            run_job(spec(work / "warm-up", 1, shards[0]))
            local: list[float] = []
            walls: dict[int | str, list[float]] = {n: [] for n in [*counts, *(["stage"] if a.stage else [])]}
            same: dict[int | str, float] = {}
            job = spec(work / "x", 0)
            processor = build_processor(a.model, job.decode, text_column=a.text_column, id_column=a.id_column,
                                        batch_size=job.batching.rows_per_task) if a.stage else None
            for rep in range(a.repeat):
                reference = None
                if a.in_process:
                    t0 = time.perf_counter()
                    reference = [r.text for r in tr.translate_batch(texts, opts)]
                    local.append(time.perf_counter() - t0)
                for n in counts:
                    out = work / f"out-{n}-{rep}"
                    t0 = time.perf_counter()
                    run_job(spec(out, n))
                    walls[n].append(time.perf_counter() - t0)
                    got = hypotheses(out)
                    reference = got if reference is None else reference
                    same[n] = sum(x == y for x, y in zip(got, reference)) / len(reference)
                    print(f"rep {rep}: {n} actors {walls[n][-1]:.2f} s", flush=True)
                if processor is not None:
                    out = work / f"out-stage-{rep}"
                    t0 = time.perf_counter()
                    processor(ray.data.read_parquet(str(source))).write_parquet(str(out))
                    walls["stage"].append(time.perf_counter() - t0)
                    got = {r["id"]: r["hyp"] for r in pq.read_table(out, columns=["id", "hyp"]).to_pylist()}
                    ids = [i for f in sorted(source.glob("*.parquet"))
                           for i in pq.read_table(f, columns=[a.id_column]).column(0).to_pylist()]
                    same["stage"] = sum(got.get(i) == y for i, y in zip(ids, reference)) / len(reference)
                    print(f"rep {rep}: stage {walls['stage'][-1]:.2f} s", flush=True)
        finally:
            disconnect(conn)
        decode_s = statistics.median(local) if local else None
        if local:
            results.add({"layout": f"in-process, {threads} threads", "rows": len(texts), "wall_s": round(decode_s, 3),
                         "sentences_per_s": round(len(texts) / decode_s, 1)})
        for n in counts:
            wall, plan = statistics.median(walls[n]), plans[n]
            results.add({"layout": f"{plan.actors} actors x {plan.torch_threads} threads"
                                   + (" (default)" if n == 0 else ""), "rows": len(texts),
                         "wall_s": round(wall, 3), "sentences_per_s": round(len(texts) / wall, 1),
                         "efficiency": round(decode_s / wall, 3) if local else None,
                         "identical": round(same[n], 4)})
        if a.stage:
            wall, job_wall = statistics.median(walls["stage"]), statistics.median(walls[0 if 0 in counts else counts[0]])
            results.add({"layout": "Ray Data stage (jobs.build_processor), default pool", "rows": len(texts),
                         "wall_s": round(wall, 3), "sentences_per_s": round(len(texts) / wall, 1),
                         "efficiency": round(decode_s / wall, 3) if local else None, "vs_job": round(job_wall / wall, 3),
                         "identical": round(same["stage"], 4)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r.get("identical", 1) == 1 for r in results.runs) else 1


def hash_inputs(a: argparse.Namespace) -> int:
    """The cost of a job's input check: each unit's slice hashed as a decode actor hashes it
    (`jobs.units.open_slice`), over every unit of `--input`'s Parquet files (or a file of `--from-tsv`'s
    column repeated `--copies` times), against the decode rate `--decode-rate` rows/s."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.inputs import Shard, read_footer
    from jobs.units import open_slice, plan_units

    results = Results(a.out, "hash", {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()
                                      if k != "func"})
    with tempfile.TemporaryDirectory() as tmp:
        if a.from_tsv:
            import pyarrow.csv as pcsv

            table = pcsv.read_csv(a.from_tsv, parse_options=pcsv.ParseOptions(delimiter="\t", quote_char=False))
            files = [Path(tmp) / "input.parquet"]
            pq.write_table(pa.table({"src": pa.concat_arrays([table.column(a.tsv_column).combine_chunks()] * a.copies)}),
                           files[0], row_group_size=a.row_group_size)
        else:
            files = sorted(a.input.glob("*.parquet"))
        for path in files:
            schema, rows, groups, identity = read_footer(str(path))
            shard = Shard(path=str(path), stem=path.stem, rows=rows, schema=schema, passthrough=(),
                          row_groups=groups, identity=identity)
            units = plan_units([shard], a.rows_per_task)
            hashed, seconds = 0, 0.0
            for unit in units:
                with open_slice(unit) as s:
                    hashed += s.bytes
                    seconds += s.seconds
            results.add({"file": path.name, "mb": round(path.stat().st_size / 1e6, 1), "rows": rows,
                         "units": len(units), "hashed_mb": round(hashed / 1e6, 1),
                         "mb_per_s": round(hashed / 1e6 / seconds, 1), "rows_per_s": round(rows / seconds),
                         "percent_of_decode": round(100 * a.decode_rate / (rows / seconds), 3)})
    return 0


def add_hash_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--input", type=Path, default=None, help="a folder of Parquet files")
    ap.add_argument("--from-tsv", type=Path, default=None, help="one file of this TSV's column instead")
    ap.add_argument("--tsv-column", default="noisy")
    ap.add_argument("--copies", type=int, default=20, help="--from-tsv: the column repeated this many times")
    ap.add_argument("--row-group-size", type=int, default=65536)
    ap.add_argument("--rows-per-task", type=int, default=4096, help="rows of a unit (a job's default)")
    ap.add_argument("--decode-rate", type=float, required=True, help="the job's decode rate, rows/s")
    ap.add_argument("--out", type=Path, default=None)
