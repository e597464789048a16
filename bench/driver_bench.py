"""What the job driver costs as inputs grow: driver CPU per 1,000 rows, driver peak RSS, and the rows/s
the driver could coordinate (rows / driver CPU seconds), at 10k and 100k rows.

    python bench/driver_bench.py --rows 10000,100000 --out bench/results/driver.json

Each size runs in a fresh driver process (its own embedded Ray, default actor layout) over one
Parquet file of that many rows (the gec training sources, repeated as needed), decoded greedily by a
tiny model (tests/conftest.build_tiny_model) so that decoding is cheap and the driver's share shows;
the driver's own CPU time (user + system, its threads, not Ray's worker processes) and its peak RSS
are read in that process. Also reported: the job's fixed costs (Ray start-up, the wall time of a
10-row job). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

CHILD = r"""
import json, os, resource, sys, time
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, {repo!r})
import psutil
from cluster.connection import connect, disconnect
from jobs.run import run_job
from jobs.spec import load_spec
me = psutil.Process()
t0 = time.perf_counter()
conn = connect(None, log_to_driver=False)
ray_s = time.perf_counter() - t0
spec = load_spec(None, ["model={model}", "input.path={inp}", "output.dir={out}", "decode.method=greedy",
                        "input.text_column=src", "input.id_column=none", "batching.rows_per_task={unit}"])
c0, w0 = me.cpu_times(), time.perf_counter()
job = run_job(spec)
c1, w1 = me.cpu_times(), time.perf_counter()
disconnect(conn)
print("RESULT " + json.dumps({{"rows": job.rows, "wall_s": w1 - w0, "ray_init_s": ray_s,
      "driver_cpu_s": (c1.user - c0.user) + (c1.system - c0.system),
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "units": len(job.committed)}}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="10000,100000")
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "gec" / "train.tsv"))
    ap.add_argument("--rows-per-task", type=int, default=4096)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "driver.json"))
    args = ap.parse_args(argv)

    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import build_tiny_model, synthetic_sentences

    from aggdec.train.ar import read_tsv

    work = Path(tempfile.mkdtemp(prefix="driver-bench-"))
    model = build_tiny_model(work / "tiny")
    texts = read_tsv(args.data, "noisy", "clean")[0] if Path(args.data).is_file() else synthetic_sentences(20000)
    runs = []
    for n in [10, *(int(r) for r in args.rows.split(","))]:
        inp = work / f"in-{n}"
        inp.mkdir()
        rows = (texts * (n // len(texts) + 1))[:n]
        pq.write_table(pa.table({"src": rows}), inp / "part-00000.parquet", row_group_size=8192)
        code = CHILD.format(repo=str(REPO), model=model, inp=inp, out=work / f"out-{n}", unit=args.rows_per_task)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=dict(os.environ, RAY_AUTH_MODE="disabled"))
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            return 1
        r = json.loads(line[len("RESULT "):])
        r["driver_cpu_ms_per_1000_rows"] = 1000 * r["driver_cpu_s"] / r["rows"] * 1000
        r["coordination_rows_per_s"] = r["rows"] / r["driver_cpu_s"]
        runs.append(r)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    result = {"model": "tiny test model (tests/conftest.build_tiny_model)", "rows_per_task": args.rows_per_task,
              "cpus": os.cpu_count(), "runs": runs, "fixed_cost_small_job": runs[0]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
