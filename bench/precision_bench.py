"""fp32 against the certified bf16 top-1 (`verify_precision`) on the shipped models, interleaved.

    python bench/precision_bench.py --repeat 3 --out bench/results/precision.json

Per case (model, method, batch size): sentences/s with `fp32` and with `bf16-certified` (medians of
`--repeat` interleaved runs in one process), their ratio, and whether the outputs are identical
(they must be). What `verify_precision = "auto"` picks on a CPU follows from such runs
(aggdec.model.projection.certified_pays). Not a test.
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

from aggdec.api import Translator, decode_options
from aggdec.train.ar import read_tsv

DATA = REPO.parent / "shared" / "data"
CASES = [  # model, data, source column, method, batch size, sentences
    ("ende-base", "ende", "en", "greedy", 1, 100),
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
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    for model, data, column, method, bs, n in CASES:
        src, _ = read_tsv(DATA / data / "test.tsv", column, column)
        tr = Translator.load(REPO / "models" / model)
        times: dict[str, list[float]] = {"fp32": [], "bf16-certified": []}
        outputs = {}
        for _ in range(a.repeat):
            for precision in times:
                t0 = time.perf_counter()
                res = tr.translate_batch(src[:n], decode_options(method, max_batch_size=bs, verify_precision=precision))
                times[precision].append(time.perf_counter() - t0)
                outputs[precision] = [r.tokens for r in res]
        fp32, bf16c = (n / statistics.median(times[p]) for p in ("fp32", "bf16-certified"))
        rows.append({"model": model, "method": method, "batch_size": bs, "sentences": n,
                     "fp32_sentences_per_s": round(fp32, 1), "bf16c_sentences_per_s": round(bf16c, 1),
                     "bf16c_vs_fp32": round(bf16c / fp32, 3),
                     "identical": outputs["fp32"] == outputs["bf16-certified"]})
        print(json.dumps(rows[-1]), flush=True)
    cpu = {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported()}
    Path(a.out).write_text(json.dumps({"machine": machine("cpu"), "cpu": cpu, "threads": a.threads,
                                       "repeat": a.repeat, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
