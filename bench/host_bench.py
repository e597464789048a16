"""Host work per decoder call: the row loop (aggdec.decoding.loop) against the slot loop
(aggdec.decoding.slot_loop) on a tiny random model, one run.

    python bench/host_bench.py --batch-sizes 1,64,256 --out bench/results/host.json

The model: d_model 32, 1 encoder and 1 decoder layer, vocabulary 64, fp32, random weights; sources
of 12-20 random tokens, outputs up to 24 tokens. Per loop and batch size: wall microseconds per
decoder call (medians over `--repeat` interleaved runs; mostly host work at small batches, not at
256 rows: `--floor`), aten operators dispatched per call (TorchDispatchMode), and host reads per iteration: calls of
item/tolist/__bool__/__int__/__float__/any/all/nonzero/cpu on tensors (TorchFunctionMode), each a
device -> host synchronization on a GPU. Greedy and IAD (draft cap 8).

`--floor` adds, per loop, the arithmetic a call cannot do without, however little host work surrounds
it: every product and attention operator of a run (the compiled step's: those of the eager slot loop,
which it compiles), each timed alone at its own inputs (median of reruns, less the cost of calling an
operator that does no work), summed per call; and the loop's host work, wall time less that floor. At
256 rows the tiny model's arithmetic is no longer negligible.

`--base PATH` adds the row loop of another source tree (a git worktree of the commit to compare
against, e.g. the decode-step issue's base `7f3abaf`): in each repeat, its own process (this script
with that tree first on the path) warms up and times the same model and requests, interleaved with
this tree's loops; its outputs must equal this tree's row loop's. Rows get `base` and
`host_time_ratio_*_vs_base` (with `--floor`, `host_work_ratio_*_vs_base`).

`--compile` adds, for greedy, the slot loop with a TorchInductor-compiled step (`compiled`; the compile happens
in a warm-up run, outside the timings; operators and host reads are not counted for it, since the
step then runs as generated C++, outside PyTorch's dispatcher).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
TREE = os.environ.get("HOST_BENCH_TREE", str(REPO))  # the tree whose aggdec is imported (a --base worker's)
sys.path.insert(0, TREE)

from aggdec.decoding.drafters import NoDraft  # noqa: E402
from aggdec.decoding.iad import InputCopy  # noqa: E402
from aggdec.decoding.loop import DraftVerifyLoop  # noqa: E402
from aggdec.decoding.metadata import Request  # noqa: E402
from aggdec.model.config import ModelConfig  # noqa: E402
from aggdec.model.transformer import Transformer  # noqa: E402

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "any", "all", "nonzero", "cpu"}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class CountReads(TorchFunctionMode):
    """Host reads of tensor values. any/all count only when their result is read (bool/item/...)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS - {"any", "all", "nonzero"}:
            self.n += 1
        return func(*args, **(kwargs or {}))


ARITHMETIC = ("aten.addmm.", "aten.mm.", "aten.bmm.", "aten.baddbmm.", "mkldnn._linear_pointwise.", "aggdec.decode_attention")
REPLAYS = 15


class Floor(TorchDispatchMode):
    """Sums each product and attention operator's time alone at its inputs: the median of REPLAYS
    reruns (the operators are pure), less the median cost of calling an operator that does no work."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0
        empty = torch.empty(0)
        self.call = self._median(torch.ops.aten.alias.default, (empty,), {})

    @staticmethod
    def _median(func, args, kwargs) -> float:
        times = []
        for _ in range(REPLAYS):
            t0 = time.perf_counter()
            func(*args, **kwargs)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func).startswith(ARITHMETIC):
            self.seconds += max(0.0, self._median(func, args, kwargs or {}) - self.call)
        return out


def floor_us(kind: str, model: Transformer, method: str, bs: int, reqs: list[Request]) -> float:
    """Microseconds per call of the arithmetic of decoding `reqs` on loop `kind` (Floor; a compiled
    step's is the eager slot loop's)."""
    loop = make("slots" if kind == "compiled" else kind, method, model, bs)
    list(loop.run(reqs))
    loop.counters.calls = 0
    with Floor() as floor:
        list(loop.run(reqs))
    return 1e6 * floor.seconds / loop.counters.calls


def write_results(path: Path, script: str, argv: list[str] | None, threads: int, rows: list[dict],
                  base: Path | None = None) -> None:
    """A results file: the command that made it, the CPU and its class (`cpu_isa`), threads, torch and
    the rows; with `base` (a worktree the command named), that tree's commit, named in the command
    instead of its path."""
    from aggdec.model.precision import cpu_isa

    args, head = list(argv or sys.argv[1:]), {}
    if base is not None:
        commit = subprocess.run(["git", "-C", str(base), "rev-parse", "--short", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        args = [f"<worktree of {commit}>" if x == str(base) else x for x in args]
        head = {"base": commit}
    path.write_text(json.dumps({"command": f"python bench/{script} " + " ".join(args), **head,
                                "cpu": platform.processor() or platform.machine(), "cpu_isa": cpu_isa(),
                                "threads": threads, "torch": torch.__version__, "rows": rows}, indent=2) + "\n")


def tiny() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab=64, tgt_vocab=64, d_model=32, enc_layers=1, dec_layers=1, enc_heads=2, dec_heads=2,
                      enc_ffn=64, dec_ffn=64, max_source_positions=64, max_target_positions=64,
                      share_all_embeddings=True)
    return Transformer(cfg).eval()


def requests(n: int, eos: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(index=i, src=[rng.randrange(4, 64) for _ in range(rng.randint(12, 20))] + [eos], max_len=24)
            for i in range(n)]


def make(kind: str, method: str, model: Transformer, bs: int):
    drafter = NoDraft() if method == "greedy" else InputCopy(max_draft=8)
    if kind == "rows":
        return DraftVerifyLoop(model, drafter, max_batch_size=bs)
    from aggdec.decoding.slot_loop import SlotLoop  # not in a --base tree from before the slot loop

    return SlotLoop(model, drafter, max_batch_size=bs, compile=kind == "compiled")


def measure(loop, reqs) -> tuple[float, int]:
    t0 = time.perf_counter()
    list(loop.run(reqs))
    return time.perf_counter() - t0, loop.counters.calls


def digest(loop, reqs) -> str:
    """A hash of a run's outputs, in request order."""
    tokens = sorted((h.index, h.tokens) for h in loop.run(reqs))
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def counted(loop, reqs) -> dict:
    """Operators and host reads per call of one run."""
    loop.counters.calls = 0
    ops, reads = CountOps(), CountReads()
    with ops, reads:
        list(loop.run(reqs))
    calls = loop.counters.calls
    return {"ops_per_call": round(ops.n / calls, 1), "host_reads_per_call": round(reads.n / calls, 2), "calls": calls}


def base_run(base: Path, weights: Path, bs: int, method: str, threads: int, runs: int, count: bool,
             floor: bool) -> dict:
    """The row loop of the `base` tree in its own process (`--worker`): the median of `runs` timed runs
    after a warm-up, its outputs' digest and, with `count`, operators and host reads (with `floor`,
    the arithmetic per call too)."""
    cmd = [sys.executable, __file__, "--worker", str(weights), "--batch-sizes", str(bs), "--method", method,
           "--threads", str(threads), "--repeat", str(runs)] + (["--count"] if count else []) + (
           ["--floor"] if floor else [])
    out = subprocess.run(cmd, env={**os.environ, "HOST_BENCH_TREE": str(base.resolve())}, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def worker(a) -> int:
    """`--worker WEIGHTS`: one row-loop measurement of this process's tree (HOST_BENCH_TREE), printed as JSON."""
    torch.set_num_threads(a.threads)
    model = tiny()
    model.load_state_dict(torch.load(a.worker, weights_only=True))
    bs = int(a.batch_sizes)
    reqs = requests(max(bs, 4) if bs > 1 else 8, model.cfg.eos)
    loop = make("rows", a.method, model, bs)
    with torch.no_grad():
        result = {"digest": digest(loop, reqs)}  # also the warm-up
        times = []
        for _ in range(a.repeat):
            loop.counters.calls = 0
            seconds, calls = measure(loop, reqs)
            times.append(1e6 * seconds / calls)
        result["us_per_call"] = round(statistics.median(times), 1)
        if a.count:
            result.update(counted(loop, reqs))
        if a.floor:
            result["floor_us_per_call"] = round(floor_us("rows", model, a.method, bs, reqs), 1)
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="also the slot loop with a compiled step")
    ap.add_argument("--floor", action="store_true", help="also the arithmetic per call and each loop's host work")
    ap.add_argument("--base", type=Path, help="also the row loop of this source tree (a worktree), in own processes")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a --base process: the model's weights
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    torch.set_num_threads(a.threads)
    model = tiny()
    eos = model.cfg.eos
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        weights = Path(tmp) / "tiny.pt"  # the model a --base process loads
        if a.base:
            torch.save(model.state_dict(), weights)
        for bs in [int(x) for x in a.batch_sizes.split(",")]:
            reqs = requests(max(bs, 4) if bs > 1 else 8, eos)
            for method in ("greedy", "iad"):
                kinds = ("rows", "slots", "compiled") if a.compile and method == "greedy" else ("rows", "slots")
                loops = {kind: make(kind, method, model, bs) for kind in kinds}
                if "compiled" in loops:
                    list(loops["compiled"].run(reqs))  # compiles
                times: dict[str, list[float]] = {k: [] for k in loops}
                base = []
                for i in range(a.repeat):  # interleaved
                    if a.base:
                        first = i == 0
                        base.append(base_run(a.base, weights, bs, method, a.threads, 3, first, a.floor and first))
                    for kind, loop in loops.items():
                        loop.counters.calls = 0
                        seconds, calls = measure(loop, reqs)
                        times[kind].append(1e6 * seconds / calls)
                result = {"batch_size": bs, "method": method}
                for kind, loop in loops.items():
                    result[kind] = {"us_per_call": round(statistics.median(times[kind]), 1)}
                    if kind != "compiled":
                        result[kind].update(counted(loop, reqs))
                for kind in kinds[1:]:
                    ratio = result["rows"]["us_per_call"] / result[kind]["us_per_call"]
                    result[f"host_time_ratio_{kind}"] = round(ratio, 2)
                if base:
                    mine = digest(loops["rows"], reqs)
                    if any(b["digest"] != mine for b in base):
                        raise SystemExit(f"batch {bs} {method}: the base tree's outputs differ from this tree's")
                    median = statistics.median(b["us_per_call"] for b in base)
                    result["base"] = {**base[0], "us_per_call": round(median, 1)}
                    del result["base"]["digest"]
                    for kind in kinds:
                        ratio = result["base"]["us_per_call"] / result[kind]["us_per_call"]
                        result[f"host_time_ratio_{kind}_vs_base"] = round(ratio, 2)
                if a.floor:
                    floors = {kind: floor_us(kind, model, method, bs, reqs) for kind in ("rows", "slots")}
                    for kind in kinds:
                        floor = floors["slots" if kind == "compiled" else kind]
                        result[kind]["floor_us_per_call"] = round(floor, 1)
                        result[kind]["host_us_per_call"] = round(result[kind]["us_per_call"] - floor, 1)
                    for kind in kinds[1:]:
                        ratio = result["rows"]["host_us_per_call"] / result[kind]["host_us_per_call"]
                        result[f"host_work_ratio_{kind}"] = round(ratio, 2)
                    if base:
                        b = result["base"]
                        b["host_us_per_call"] = round(b["us_per_call"] - b["floor_us_per_call"], 1)
                        for kind in kinds:
                            ratio = b["host_us_per_call"] / result[kind]["host_us_per_call"]
                            result[f"host_work_ratio_{kind}_vs_base"] = round(ratio, 2)
                print(json.dumps(result), flush=True)
                rows.append(result)
    if a.out:
        write_results(a.out, "host_bench.py", argv, a.threads, rows, a.base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
