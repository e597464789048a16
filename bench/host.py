"""`host`: the host work of a decoder call of the decode loop (aggdec.decoding.slot_loop), its eager
(packed) step and (`--compile`) greedy's compiled step, on a model so small that a call is mostly host
work.

The model: d_model 32, 1 encoder and 1 decoder layer, vocabulary 64, fp32, random weights; sources of
12-20 random tokens, outputs up to 24 tokens; greedy and IAD (draft cap 8). Per loop and batch size:
wall microseconds per decoder call (median of `--repeat` interleaved runs), aten operators
dispatched per call, and host reads per call (item/tolist/__bool__/... on tensors: each one a
device -> host synchronization on a GPU). `--compile` adds greedy's loop with a compiled step
(compiled before the timings; it runs as generated code, outside the dispatcher, so its operators and
reads are not counted). `--floor` adds the arithmetic a call cannot do without: every product and
attention operator of a run timed alone at its own inputs (median of reruns, less the cost of
calling an operator that does nothing), summed per call; host work is wall time less that floor.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.record import Results

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu"}
ARITHMETIC = ("aten.linear.", "aten.addmm.", "aten.mm.", "aten.bmm.", "aten.baddbmm.", "mkldnn._linear_pointwise.",
              "aggdec.decode_attention")
REPLAYS = 15


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="also greedy's slot loop with a compiled step")
    ap.add_argument("--floor", action="store_true", help="also the arithmetic per call and each loop's host work")
    ap.add_argument("--out", type=Path, default=None)


def modes():
    """(CountOps, CountReads, Floor): the dispatch and function modes that count and time a run."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    class CountReads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in READS:
                self.n += 1
            return func(*args, **(kwargs or {}))

    def median_seconds(func, args, kwargs) -> float:
        times = []
        for _ in range(REPLAYS):
            t0 = time.perf_counter()
            func(*args, **kwargs)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    class Floor(TorchDispatchMode):
        """Sums each product and attention operator's time alone at its inputs (they are pure)."""

        def __init__(self):
            super().__init__()
            self.seconds = 0.0
            self.call = median_seconds(torch.ops.aten.alias.default, (torch.empty(0),), {})

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func).startswith(ARITHMETIC):
                self.seconds += max(0.0, median_seconds(func, args, kwargs or {}) - self.call)
            return out

    return CountOps, CountReads, Floor


def tiny():
    import torch

    from aggdec.model.config import ModelConfig
    from aggdec.model.transformer import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(src_vocab=64, tgt_vocab=64, d_model=32, enc_layers=1, dec_layers=1, enc_heads=2, dec_heads=2,
                      enc_ffn=64, dec_ffn=64, max_source_positions=64, max_target_positions=64,
                      share_all_embeddings=True)
    return Transformer(cfg).eval()


def requests(n: int, eos: int) -> list:
    from aggdec.decoding.metadata import Request

    rng = random.Random(0)
    return [Request(index=i, src=[rng.randrange(4, 64) for _ in range(rng.randint(12, 20))] + [eos], max_len=24)
            for i in range(n)]


def make(kind: str, method: str, model, bs: int):
    from aggdec.decoding.drafters import NoDraft
    from aggdec.decoding.iad import InputCopy
    from aggdec.decoding.slot_loop import SlotLoop

    drafter = NoDraft() if method == "greedy" else InputCopy(max_draft=8)
    return SlotLoop(model, drafter, max_batch_size=bs, compile=kind == "compiled")


def per_call(loop, reqs, mode=None) -> tuple[float, int, Any]:
    """(wall seconds, decoder calls, the mode) of one run, under `mode` when given."""
    loop.counters.calls = 0
    t0 = time.perf_counter()
    if mode is None:
        list(loop.run(reqs))
    else:
        with mode:
            list(loop.run(reqs))
    return time.perf_counter() - t0, loop.counters.calls, mode


def main(a: argparse.Namespace) -> int:
    import torch

    CountOps, CountReads, Floor = modes()
    torch.set_num_threads(a.threads)
    model = tiny()
    results = Results(a.out, "host", {k: v for k, v in vars(a).items() if k not in ("out", "func", "command")})
    with torch.inference_mode():
        for bs in [int(x) for x in a.batch_sizes.split(",")]:
            reqs = requests(max(bs, 4) if bs > 1 else 8, model.cfg.eos)
            for method in ("greedy", "iad"):
                kinds = ["eager"] + (["compiled"] if a.compile and method == "greedy" else [])
                loops = {kind: make(kind, method, model, bs) for kind in kinds}
                outputs = {kind: sorted((h.index, h.tokens) for h in loop.run(reqs)) for kind, loop in loops.items()}
                times: dict[str, list[float]] = {k: [] for k in loops}
                for _ in range(a.repeat):  # interleaved
                    for kind, loop in loops.items():
                        seconds, calls, _ = per_call(loop, reqs)
                        times[kind].append(1e6 * seconds / calls)
                for kind, loop in loops.items():
                    run = {"batch_size": bs, "method": method, "loop": kind,
                           "us_per_call": round(statistics.median(times[kind]), 1),
                           "identical_to_eager": outputs[kind] == outputs["eager"]}
                    if kind != "compiled":
                        _, calls, ops = per_call(loop, reqs, CountOps())
                        _, _, reads = per_call(loop, reqs, CountReads())
                        run.update(ops_per_call=round(ops.n / calls, 1), host_reads_per_call=round(reads.n / calls, 2))
                    if a.floor:  # a compiled step's arithmetic is the eager slot loop's, which it compiles
                        measured = loops["eager" if kind == "compiled" else kind]
                        _, calls, floor = per_call(measured, reqs, Floor())
                        run["floor_us_per_call"] = round(1e6 * floor.seconds / calls, 1)
                        run["host_us_per_call"] = round(run["us_per_call"] - run["floor_us_per_call"], 1)
                    results.add(run)
    return 1 if results.failed or not all(r["identical_to_eager"] for r in results.runs) else 0
