"""How much of decoding a shipped model is its arithmetic: wall time against the floor of
`host_bench.Floor`, through the public API, one process.

    python bench/floor_bench.py --runs ende-base:greedy:1:100,gec-base:iad:64:512 \
        --out bench/results/floor-real.json

Each run `model:method:batch_size:sentences` decodes the first sentences of the model's test set
(`tree_compare.test_sources`) with default options but the method and batch size: after a warm-up,
the best of `--repeat` timed runs, then one run under `Floor`, which reruns every product and
attention operator alone at its inputs and sums the medians. Host share: 1 - floor / wall. The
reruns find their weights and inputs in the caches the first run left, so on a model whose weights
stream from memory at every call (batch 1) the floor is low and the host share high; operators
other than products and attention (softmax, top-1, cache writes) count as host work here.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from aggdec.api import Translator  # noqa: E402
from aggdec.decoding.methods import options_from_mapping  # noqa: E402
from host_bench import Floor  # noqa: E402
from tree_compare import test_sources  # noqa: E402


def measure(model: str, method: str, bs: int, limit: int, data: str, repeat: int) -> dict:
    """Wall seconds (best of `repeat`) and floor seconds of decoding `limit` sentences."""
    sources = test_sources(data, model, limit)
    tr = Translator.load(str(REPO / "models" / model))
    opts = options_from_mapping({"method": method, "max_batch_size": bs}, method)[0]
    tr.translate_batch(sources[: max(2 * bs, 8)], opts)  # warm-up
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        tr.translate_batch(sources, opts)
        walls.append(time.perf_counter() - t0)
    with Floor() as floor:
        tr.translate_batch(sources, opts)
    wall = min(walls)
    return {"model": model, "method": method, "batch_size": bs, "sentences": len(sources), "wall_s": round(wall, 3),
            "floor_s": round(floor.seconds, 3), "host_share": round(1 - floor.seconds / wall, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="model:method:batch_size:sentences, comma-separated")
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    for run in a.runs.split(","):
        model, method, bs, limit = run.split(":")
        row = measure(model, method, int(bs), int(limit), a.data, a.repeat)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        a.out.write_text(json.dumps({"command": "python bench/floor_bench.py " + " ".join(argv or sys.argv[1:]),
                                     "cpu": platform.processor() or platform.machine(), "threads": a.threads,
                                     "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
