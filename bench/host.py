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

`roofline`: the most sentences/s batch-1 greedy decoding of a model can reach in fp32 on this CPU, and
how close the systems of a `compare` run came to it; a model directory or a shape (bench/compare.py,
`SHAPES`), whose outputs run to `--max-new` as in `compare`.

At batch 1 a decoder step multiplies one vector by every weight of the decoder's step: each layer's
self-attention products (query, key, value, output), its cross-attention's query and output (the keys
and values are the encoder's, computed once a sentence), its feed-forward products, and the output
projection. A matrix-vector product reads each weight once and does one multiply-add with it, so at
these sizes it runs at the speed weights stream from the caches and memory, and a step can take no
less than reading those weights takes. Measured here with the model's own weights, the faster of their
products on one row (`F.linear`) and plain reads (a sum over each: where a product kernel streams slower
than memory, as ATen's one-row product does on large models), at each layout P x T on `--threads`
cores: P processes started together, T threads each, each with its own copy of the weights (as
CTranslate2's `inter_threads` workers and aggdec's processes hold them); a layout's rate is the sum of
its processes'. The ceiling: that rate of steps / the decoder steps a sentence takes (greedy on `--limit`
sentences of the data, end of sentence included). It leaves out the encoder, attention and everything
else a step does; one at a share s of it can gain at most 1/s without reading fewer bytes a step (lower
precision, or more sentences a step). A system above it shows that these reads fell short of the
memory's peak (a 484M model's compiled step, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.compare import SHAPES, recorded, resolve
from bench.record import Results, load
from bench.systems import layouts

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


def add_roofline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="a model directory, or a shape built with random weights: " + ", ".join(SHAPES)
                        + " (bench/compare.py: its tokenizer trained on --data's --column)")
    p.add_argument("--data", type=Path, required=True, help="a TSV with a header line")
    p.add_argument("--column", required=True, help="the source column")
    p.add_argument("--limit", type=int, default=100, help="sentences greedy decodes to count steps a sentence")
    p.add_argument("--max-new", type=int, default=None,
                   help="every output at most N tokens, as `compare --max-new`: for random-weight models")
    p.add_argument("--work", type=Path, default=None, help="a shape's model (default: a temporary folder)")
    p.add_argument("--threads", type=int, default=2, help="cores: every layout P x T with P * T <= this")
    p.add_argument("--seconds", type=float, default=3.0, help="how long each process streams, a repeat")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repeats; a figure is their median")
    p.add_argument("--compare", type=Path, nargs="*", default=[],
                   help="`compare` results at batch 1: each system's share of the ceiling at its layout")
    p.add_argument("--out", type=Path, default=None, help="the results file (bench/record.py)")


def step_weights(model) -> list:
    """The weights a batch-1 decoder step multiplies by (module docstring), as contiguous fp32 copies."""
    import torch

    weights = []
    for layer in model.decoder.layers:
        for attn, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "out_proj")),
                            (layer.encoder_attn, ("q_proj", "out_proj"))):
            weights += [getattr(attn, name).weight for name in names]
        weights += [fc.weight for fc in (layer.fc1, layer.fc3, layer.fc2) if fc is not None]
    projection = model.decoder.output_projection
    weights.append(model.decoder.embed_tokens.weight if projection is None else projection.weight)
    return [w.detach().to(torch.float32).contiguous().clone() for w in weights]


def _stream(weights: list, threads: int, seconds: float, start, out) -> None:
    """A process of a layout: a step's weights streamed for `seconds` after `start` (a barrier), half the
    time as the step's products on one row (`F.linear`), half as plain reads (a sum over each weight:
    the memory's rate where a product kernel streams slower); puts the faster (steps, seconds) on `out`."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    weights = [w.clone() for w in weights]  # its own copy, as a worker of its own holds one
    rows = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    passes = (lambda w: F.linear(rows[w.shape[1]], w), torch.sum)
    with torch.inference_mode():
        for _ in range(20):
            for w in weights:
                for one in passes:
                    one(w)
        start.wait()
        best = None
        for one in passes:
            steps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 2:
                for w in weights:
                    one(w)
                steps += 1
            found = (steps, time.perf_counter() - t0)
            best = found if best is None or found[0] / found[1] > best[0] / best[1] else best
        out.put(best)


def steps_per_second(weights: list, workers: int, threads: int, seconds: float) -> float:
    """Decoder steps a second at batch 1, summed over `workers` processes of `threads` threads."""
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_stream, args=(weights, threads, seconds, start, out)) for _ in range(workers)]
    for p in procs:
        p.start()
    rates = [steps / s for steps, s in (out.get() for _ in procs)]
    for p in procs:
        p.join()
    return sum(rates)


def steps_per_sentence(translator, sources: list[str], max_new: int | None) -> float:
    """Decoder steps a sentence of eager greedy at batch 1 (verifier calls, the end of sentence's included),
    each output at most `max_new` tokens where given (else the decode options' length rule)."""
    limit = {"max_len_a": 0, "max_len_b": max_new} if max_new else {}
    res = translator.translate_batch(sources, method="greedy", max_batch_size=1, compile=False, **limit)
    return sum(r.stats.iterations for r in res) / len(res)


def roofline(a: argparse.Namespace) -> int:
    import torch

    from aggdec.api import Translator

    with a.data.open(encoding="utf-8", newline="") as f:
        sources = [row[a.column] for _, row in zip(range(a.limit), csv.DictReader(f, delimiter="\t"))]
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as temporary:
        translator = Translator.load(resolve(a.model, a.data, a.column, a.work or Path(temporary)))
        steps = steps_per_sentence(translator, sources, a.max_new)
        weights = step_weights(translator.model)
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    results = Results(a.out, "roofline", recorded(a))
    grid = layouts(a.threads)
    rates: dict[str, list[float]] = {f"{p}x{t}": [] for p, t in grid}
    for _ in range(a.repeat):  # interleaved
        for p, t in grid:
            rates[f"{p}x{t}"].append(steps_per_second(weights, p, t, a.seconds))
    ceiling = {}
    for layout, found in rates.items():
        rate = statistics.median(found)
        ceiling[layout] = rate / steps
        results.add({"layout": layout, "step_weights_mb": round(megabytes, 2),
                     "us_per_step": round(1e6 * int(layout.split("x")[0]) / rate, 1),
                     "gb_per_s": round(rate * megabytes / 1e3, 1), "steps_per_sentence": round(steps, 2),
                     "ceiling_sentences_per_s": round(ceiling[layout], 1)})
    for path in a.compare:
        for run in load(path)["runs"]:
            if run.get("batch_size") == 1 and run.get("layout") in ceiling and "sentences_per_s" in run:
                results.add({"system": run["system"], "layout": run["layout"], "from": path.name,
                             "sentences_per_s": run["sentences_per_s"],
                             "share_of_ceiling": round(run["sentences_per_s"] / ceiling[run["layout"]], 3)})
    return 0
