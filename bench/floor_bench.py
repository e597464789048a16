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
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from aggdec.api import Translator  # noqa: E402
from aggdec.decoding.methods import options_from_mapping  # noqa: E402
from host_bench import Floor, write_results  # noqa: E402
from tree_compare import test_sources  # noqa: E402


def measure(model: str, method: str, bs: str, limit: str, *, data: str, repeat: int) -> dict:
    """Wall seconds (best of `repeat`) and floor seconds of decoding `limit` sentences at batch size
    `bs` (both as a run names them); printed as a JSON line, and returned."""
    batch = int(bs)
    sources = test_sources(data, model, int(limit))
    tr = Translator.load(str(REPO / "models" / model))
    opts = options_from_mapping({"method": method, "max_batch_size": batch}, method)[0]
    tr.translate_batch(sources[: max(2 * batch, 8)], opts)  # warm-up
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        tr.translate_batch(sources, opts)
        walls.append(time.perf_counter() - t0)
    with Floor() as floor:
        tr.translate_batch(sources, opts)
    wall = min(walls)
    row = {"model": model, "method": method, "batch_size": batch, "sentences": len(sources), "wall_s": round(wall, 3),
           "floor_s": round(floor.seconds, 3), "host_share": round(1 - floor.seconds / wall, 3)}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="model:method:batch_size:sentences, comma-separated")
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = [measure(*run.split(":"), data=a.data, repeat=a.repeat) for run in a.runs.split(",")]
    if a.out:
        write_results(a.out, "floor_bench.py", argv, a.threads, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
