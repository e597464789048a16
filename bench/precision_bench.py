"""Precisions on the shipped models, interleaved in one process. Not a test.

    python bench/precision_bench.py --repeat 3 --out bench/results/precision.json
    python bench/precision_bench.py --verifier --sentences 200 --batch-size 32 --out bench/results/precision-avx2.json
    python bench/precision_bench.py --top1 --out bench/results/precision-top1.json

Default: fp32 against the certified bf16 top-1 (`verify_precision`). Per case (model, method, batch
size): sentences/s with `fp32`, with `bf16-certified` and with `auto` (medians of `--repeat`
interleaved runs), the ratios to fp32, and whether the outputs are identical (they must be). What `verify_precision = "auto"`
picks on a CPU follows from such runs (aggdec.model.projection.certified_pays).

`--verifier`: the verifier's `precision` (fp32, bf16, int8) for gec-base greedy and IAD on the
shipped sample corpus (examples/data/gec-sample, no ../shared needed): sentences/s, the share of
sentences identical to fp32 greedy (how close bf16 and int8 stay; it depends on the instruction
set, so it is measured here and not asserted in the tests) and whether IAD equals greedy at the
same precision. The CPU's class (aggdec.model.precision.cpu_isa) is recorded with the figures;
what `cpu_warning` says per class follows from such runs.

`--top1`: the output projection's top-1 alone, fp32 against certified bf16, at 1 to 128 positions a
call, on the verifier states of a greedy run over each shipped model's test set (median of 30 calls
of positions drawn at random; the two must agree): where `verify_precision = "auto"` starts
certifying (aggdec.model.projection.AUTO_CERTIFIED_ROWS) follows from such runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from baseline_bench import machine

import pyarrow.parquet as pq

from aggdec.api import Translator, decode_options
from aggdec.model.precision import PRECISIONS, cpu_isa
from aggdec.train.ar import read_tsv

DATA = REPO.parent / "shared" / "data"
CASES = [  # model, data, source column, method, batch size, sentences
    ("ende-base", "ende", "en", "greedy", 1, 100),
    ("ende-base", "ende", "en", "greedy", 8, 300),
    ("ende-base", "ende", "en", "greedy", 64, 1000),
    ("ende-base-double-token", "ende", "en", "greedy", 64, 1000),
    ("gec-base", "gec", "noisy", "iad", 1, 100),
    ("gec-base", "gec", "noisy", "iad", 64, 1000),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "precision.json"))
    ap.add_argument("--verifier", action="store_true", help="compare the verifier's precision (fp32, bf16, int8)")
    ap.add_argument("--sentences", type=int, default=300, help="--verifier: first N sentences of the sample corpus")
    ap.add_argument("--batch-size", type=int, default=32, help="--verifier: max_batch_size")
    ap.add_argument("--top1", action="store_true", help="the output projection's top-1 alone, by positions a call")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.verifier:
        return verifier_precisions(a)
    if a.top1:
        return top1_by_rows(a)
    rows = []
    for model, data, column, method, bs, n in CASES:
        src, _ = read_tsv(DATA / data / "test.tsv", column, column)
        tr = Translator.load(REPO / "models" / model)
        times: dict[str, list[float]] = {"fp32": [], "bf16-certified": [], "auto": []}
        outputs = {}
        for _ in range(a.repeat):
            for precision in times:
                t0 = time.perf_counter()
                res = tr.translate_batch(src[:n], decode_options(method, max_batch_size=bs, verify_precision=precision))
                times[precision].append(time.perf_counter() - t0)
                outputs[precision] = [r.tokens for r in res]
        fp32, bf16c, auto = (n / statistics.median(times[p]) for p in ("fp32", "bf16-certified", "auto"))
        rows.append({"model": model, "method": method, "batch_size": bs, "sentences": n,
                     "fp32_sentences_per_s": round(fp32, 1), "bf16c_sentences_per_s": round(bf16c, 1),
                     "auto_sentences_per_s": round(auto, 1), "bf16c_vs_fp32": round(bf16c / fp32, 3),
                     "auto_vs_fp32": round(auto / fp32, 3),
                     "identical": outputs["fp32"] == outputs["bf16-certified"] == outputs["auto"]})
        print(json.dumps(rows[-1]), flush=True)
    cpu = {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported()}
    Path(a.out).write_text(json.dumps({"machine": machine("cpu"), "cpu": cpu, "threads": a.threads,
                                       "repeat": a.repeat, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    return 0


def top1_by_rows(a: argparse.Namespace) -> int:
    """fp32 against certified top-1 by positions a call; see the module docstring."""
    rows = []
    for model, data, column in (("ende-base", "ende", "en"), ("gec-base", "gec", "noisy")):
        src, _ = read_tsv(DATA / data / "test.tsv", column, column)
        tr = Translator.load(REPO / "models" / model)
        plain, certified = tr.projection("fp32"), tr.projection("bf16-certified")
        states = []
        top1 = plain.top1
        plain.top1 = lambda hidden, constrain: states.append(hidden.clone()) or top1(hidden, constrain)
        tr.translate_batch(src[:64], decode_options("greedy", max_batch_size=64, verify_precision="fp32"))
        del plain.top1
        states = torch.cat(states)
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for n in (1, 2, 4, 8, 16, 32, 64, 128):
                times: dict[str, list[float]] = {"fp32": [], "bf16-certified": []}
                certified.reset_counts()
                for _ in range(30):
                    h = states[torch.randint(0, states.shape[0], (n,), generator=gen)]
                    t0 = time.perf_counter()
                    want = plain.top1(h, lambda z, at: None)
                    t1 = time.perf_counter()
                    got = certified.top1(h, lambda z, at: None)
                    times["fp32"].append(t1 - t0)
                    times["bf16-certified"].append(time.perf_counter() - t1)
                    assert torch.equal(got, want), "the certified top-1 differs from fp32's"
                fp32, bf16c = (1e6 * statistics.median(times[p]) for p in times)
                rows.append({"model": model, "positions": n, "fp32_us": round(fp32, 1), "bf16c_us": round(bf16c, 1),
                             "bf16c_speedup": round(fp32 / bf16c, 2), **certified.counts()})
                print(json.dumps(rows[-1]), flush=True)
    Path(a.out).write_text(json.dumps({"machine": machine("cpu"), "cpu_isa": cpu_isa(), "threads": a.threads,
                                       "rows": rows}, indent=1) + "\n", encoding="utf-8")
    return 0


def verifier_precisions(a: argparse.Namespace) -> int:
    """gec-base greedy and IAD at every `precision` on the sample corpus; see the module docstring."""
    files = sorted((REPO / "examples" / "data" / "gec-sample").glob("*.parquet"))
    src = [s for f in files for s in pq.read_table(f, columns=["src"]).column("src").to_pylist()][:a.sentences]
    tr = Translator.load(REPO / "models" / "gec-base")
    for precision in PRECISIONS:  # convert and compile (int8: TorchInductor) before any timing
        tr.translate_batch(src[:4], decode_options("iad", precision=precision))
    times: dict[tuple[str, str], list[float]] = {}
    outputs = {}
    for _ in range(a.repeat):
        for method in ("greedy", "iad"):
            for precision in PRECISIONS:
                t0 = time.perf_counter()
                res = tr.translate_batch(src, decode_options(method, precision=precision, max_batch_size=a.batch_size))
                times.setdefault((method, precision), []).append(time.perf_counter() - t0)
                outputs[method, precision] = [r.tokens for r in res]
    reference = outputs["greedy", "fp32"]
    rows = []
    for (method, precision), ts in times.items():
        out = outputs[method, precision]
        rows.append({"method": method, "precision": precision, "batch_size": a.batch_size, "sentences": len(src),
                     "sentences_per_s": round(len(src) / statistics.median(ts), 1),
                     "identical_to_fp32_greedy": round(sum(x == y for x, y in zip(out, reference)) / len(src), 4),
                     "identical_to_greedy_same_precision": out == outputs["greedy", precision]})
        print(json.dumps(rows[-1]), flush=True)
    Path(a.out).write_text(json.dumps({"machine": machine("cpu"), "cpu_isa": cpu_isa(), "model": "gec-base",
                                       "data": "examples/data/gec-sample", "threads": a.threads, "repeat": a.repeat,
                                       "rows": rows}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
