"""What one batch-1 greedy step's products cost when its weights are in the CPU's caches and when
they are not, against a plain read of the same bytes: whether a step is bound by memory traffic.

    python bench/weight_stream_bench.py --model models/ende-base --out bench/results/weight-stream.json

The step's products are the decoder's (every linear layer of every decoder layer but the cross
K/V, which are computed once per sentence) and the output projection, one row each, fp32, with the
model's weights, in the order a step runs them. Timed (medians of 5 rounds) three ways: back to back
(`hot`: the weights stay in the caches between steps); with `--evict-mb` of other data written
before each step (`evicted`, that write timed alone and subtracted), as a real decode's encoder,
caches and other processes on the machine do; each also with every product on MKL (`F.linear`)
and every product on oneDNN's prepacked weights (`*_mkl_us`, `*_onednn_us`); and a plain sum over
a buffer of the weights' size, in and out of the caches (`read_*`: the memory bandwidth those bytes
need). Also the same products at `--rows` rows (IAD and beam search multiply many rows by each
weight read).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from baseline_bench import machine

from aggdec.api import Translator
from aggdec.model import linear as lin
from aggdec.model.precision import cpu_isa


def step_weights(model) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of one decoder step's products, in order; the output projection last."""
    out = []
    for layer in model.decoder.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.out_proj,
                    layer.encoder_attn.q_proj, layer.encoder_attn.out_proj, layer.fc1, layer.fc2):
            out.append((lin.weight.detach(), None if lin.bias is None else lin.bias.detach()))
    out.append((model.output_weight.detach(), model.output_bias))
    return out


def time_us(fn, n: int, rounds: int = 5) -> float:
    for _ in range(max(3, n // 10)):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/ende-base")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--evict-mb", type=int, default=64, help="data written between steps in the evicted timing")
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    weights = step_weights(Translator.load(a.model).model)
    mb = sum(w.numel() * w.element_size() for w, _ in weights) / 2**20
    junk = torch.zeros(a.evict_mb * 2**18)  # float32: 4 bytes each
    same = torch.zeros(sum(w.numel() for w, _ in weights))
    big = torch.zeros(max(4 * (a.evict_mb * 2**18), 4 * same.numel()))

    inputs = {(rows, w.shape[1]): torch.ones(rows, w.shape[1]) for rows in (1, a.rows) for w, _ in weights}
    packed = [lin.prepack(w) for w, _ in weights]

    def step(rows: int, route: str = "model") -> None:
        """route model: as the engine multiplies (1 row: F.linear but the output projection's
        prepacked weight; more rows: every weight prepacked); mkl: F.linear; onednn: prepacked."""
        for i, (w, b) in enumerate(weights):
            x = inputs[rows, w.shape[1]]
            last = i == len(weights) - 1
            if route == "mkl" or (route == "model" and rows == 1 and not last):
                F.linear(x, w, b)
            else:
                lin.linear(x, w, b, packed=packed[i])

    with torch.no_grad():
        evict = time_us(lambda: junk.add_(1.0), 20)
        result = {
            "model": a.model, "weights_mb": round(mb, 2), "products": len(weights), "threads": a.threads,
            "cpu": machine("cpu"), "cpu_isa": cpu_isa(), "torch": torch.__version__, "evict_mb": a.evict_mb,
            "hot_us": round(time_us(lambda: step(1), 200), 1),
            "evicted_us": round(time_us(lambda: (junk.add_(1.0), step(1)), 20) - evict, 1),
            **{f"{kind}_{route}_us": round(time_us(lambda: (junk.add_(1.0) if kind == "evicted" else None,
                                                            step(1, route)), 20 if kind == "evicted" else 200)
                                           - (evict if kind == "evicted" else 0), 1)
               for route in ("mkl", "onednn") for kind in ("hot", "evicted")},
            f"hot_{a.rows}_rows_us": round(time_us(lambda: step(a.rows), 50), 1),
            f"evicted_{a.rows}_rows_us": round(time_us(lambda: (junk.add_(1.0), step(a.rows)), 20) - evict, 1),
            "read_hot_us": round(time_us(lambda: same.sum(), 200), 1),
            "read_evicted_us": round(time_us(lambda: (junk.add_(1.0), same.sum()), 20) - evict, 1),
            "read_from_memory_gb_per_s": round(big.numel() * 4 / 1e3 / time_us(lambda: big.sum(), 5), 1),
        }
    result["evicted_gb_per_s"] = round(mb * 2**20 / 1e3 / result["evicted_us"], 1)
    print(json.dumps(result, indent=1))
    if a.out:
        result["command"] = "python bench/weight_stream_bench.py " + " ".join(argv or sys.argv[1:])
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
