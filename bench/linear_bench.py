"""fp32 products through oneDNN (aggdec.model.linear) against PyTorch's F.linear (MKL), side by side.

    python bench/linear_bench.py --out bench/results/linear.json

Part 1, products: median microseconds of `F.linear`, `linear` (unpacked weight) and `linear` with
the weight prepacked for the shapes the models use (q/k/v fused: 256x768), and whether a `Linear`
layer takes its prepacked weight there (`packed_for`). `--products-only` stops after part 1.
Part 2, end to end, in one process with the two routes interleaved (`--repeat` medians): greedy and
IAD on gec/test with gec-base, greedy and GAD k=4 on ende/test with ende-base and its draft head, at
`--batch-sizes` 1 (`--bs1-limit` sentences) and 64 (`--limit`), each verify precision. The oneDNN
route includes the prepacked output projection (`use_onednn(False)` turns both off). Reports
sentences/s of both routes, their ratio, and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from baseline_bench import add_run_args, machine

from aggdec.api import Translator, decode_options
from aggdec.model import linear as lin
from aggdec.train.ar import read_tsv

SHAPES = [(m, d_in, d_out) for d_in, d_out in ((256, 256), (256, 768), (256, 1024), (1024, 256), (256, 8000))
          for m in (1, 2, 4, 8, 20, 64)]


def time_us(fn, n: int) -> float:
    """Median over 5 rounds of the mean time of `n` calls, in microseconds."""
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(rounds)


def products() -> list[dict]:
    rows = []
    with torch.no_grad():
        for m, d_in, d_out in SHAPES:
            x, w, b = torch.randn(m, d_in), torch.randn(d_out, d_in), torch.randn(d_out)
            n = max(50, 200_000 // max(1, m * d_out // 64))
            packed = lin.prepack(w)
            ref = time_us(lambda: F.linear(x, w, b), n)
            ours = time_us(lambda: lin.linear(x, w, b), n)
            pre = time_us(lambda: lin.linear(x, w, b, packed=packed), n)
            layer = lin.Linear(d_in, d_out)
            layer.weight.data, layer.bias.data = w, b
            rows.append({"rows": m, "in": d_in, "out": d_out, "f_linear_us": round(ref, 1), "linear_us": round(ours, 1),
                         "speedup": round(ref / ours, 2), "onednn": x.numel() * d_out >= lin.MIN_MACS,
                         "prepacked_us": round(pre, 1), "prepacked_speedup": round(ref / pre, 2),
                         "layer_takes_prepacked": lin.packed_for(layer, w, x) is not None})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gec", default="models/gec-base")
    ap.add_argument("--gec-data", default="../shared/data/gec/test.tsv")
    ap.add_argument("--ende", default="models/ende-base")
    ap.add_argument("--drafter", default="models/ende-base-draft-head")
    ap.add_argument("--ende-data", default="../shared/data/ende/test.tsv")
    add_run_args(ap, batch_sizes="1,64")
    ap.set_defaults(limit=1000, bs1_limit=100, precisions="fp32,bf16-certified", repeat=3)
    ap.add_argument("--products-only", action="store_true", help="part 1 only")
    ap.add_argument("--out", default="bench/results/linear.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not lin.enabled():
        raise SystemExit("this PyTorch has no oneDNN: nothing to compare")

    results: dict = {"machine": machine("cpu"), "torch": torch.__version__, "threads": args.threads,
                     "min_macs": lin.MIN_MACS, "products": products(), "runs": []}
    tasks = [("gec", args.gec, args.gec_data, "noisy", {"greedy": decode_options(), "iad": decode_options("iad")}),
             ("ende", args.ende, args.ende_data, "en",
              {"greedy": decode_options(), "gad-k4": decode_options("gad", drafter=args.drafter, block_size=4)})]
    for corpus, model, data, col, methods in [] if args.products_only else tasks:
        tr = Translator.load(model)
        src = read_tsv(data, col, col)[0][: args.limit]
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            sents = src[: args.bs1_limit] if bs == 1 else src
            configs = [(m, p, on) for m in methods for p in args.precisions.split(",") for on in (False, True)]
            times: dict[tuple, list[float]] = {}
            outputs: dict[tuple, list] = {}
            for rep in range(args.repeat):
                for m, prec, on in configs:
                    opts = dataclasses.replace(methods[m], max_batch_size=bs, verify_precision=prec)
                    with lin.use_onednn(on):
                        if rep == 0:  # loads drafters and warms up outside the timed runs
                            tr.translate_batch(sents[:4], opts)
                        t0 = time.perf_counter()
                        out = tr.translate_batch(sents, opts)
                        times.setdefault((m, prec, on), []).append(time.perf_counter() - t0)
                    outputs[(m, prec, on)] = [r.tokens for r in out]
            for m in methods:
                for prec in args.precisions.split(","):
                    mkl, one = (statistics.median(times[(m, prec, on)]) for on in (False, True))
                    run = {"corpus": corpus, "method": m, "precision": prec, "batch_size": bs, "sentences": len(sents),
                           "f_linear_sent_per_s": len(sents) / mkl, "onednn_sent_per_s": len(sents) / one,
                           "speedup": mkl / one, "seconds_all": {"f_linear": times[(m, prec, False)],
                                                                "onednn": times[(m, prec, True)]},
                           "identical": outputs[(m, prec, False)] == outputs[(m, prec, True)]
                           and outputs[(m, prec, True)] == outputs[("greedy", "fp32", False)]}
                    results["runs"].append(run)
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in run.items()
                                      if k != "seconds_all"}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
