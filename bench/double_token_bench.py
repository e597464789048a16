"""Double-token bidirectional decoding against the single-token model it was made from, on ende/test.

    python bench/double_token_bench.py --single models/ende-base --double models/ende-base-double-token \
        --batch-sizes 1,64 --bs1-limit 500 --repeat 3 --out bench/results/double-token.json

Per batch size, single-token greedy and beam-5 of `--single` against double-token greedy and beam-5
(pairs, aggdec.decoding.pair_beam) of `--double`, run interleaved `--repeat` times in one process:
sentences/s (median), speedup over single-token greedy, decoder calls per sentence, BLEU and chrF
(sacrebleu, signatures in the JSON) against the references. Batch 1 decodes the first `--bs1-limit`
sentences; the quality columns come from the whole `--limit`. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import sacrebleu
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from baseline_bench import machine

from aggdec.api import Translator, decode_options
from aggdec.train.ar import read_tsv

SYSTEMS = {  # name -> (model, method options)
    "single greedy": ("single", {"method": "greedy"}),
    "single beam-5": ("single", {"method": "beam", "beam": 5}),
    "double greedy": ("double", {"method": "greedy"}),
    "double beam-5": ("double", {"method": "beam", "beam": 5}),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--single", default=str(REPO / "models" / "ende-base"))
    ap.add_argument("--double", default=str(REPO / "models" / "ende-base-double-token"))
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "ende" / "test.tsv"))
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--bs1-limit", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "double-token.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    src, ref = read_tsv(a.data, "en", "de")
    src, ref = src[: a.limit], ref[: a.limit]
    models = {"single": Translator.load(a.single), "double": Translator.load(a.double)}
    assert models["double"].cfg.double_token and not models["single"].cfg.double_token
    systems = a.systems.split(",")
    bleu, chrf = sacrebleu.BLEU(), sacrebleu.CHRF()
    results: dict = {"machine": machine("cpu"), "threads": a.threads, "data": Path(a.data).name, "sentences": len(src),
                     "bs1_sentences": min(a.bs1_limit, len(src)), "repeat": a.repeat, "batch_sizes": {}}
    for bs in [int(b) for b in a.batch_sizes.split(",")]:
        n = min(a.bs1_limit, len(src)) if bs == 1 else len(src)
        times: dict[str, list[float]] = {s: [] for s in systems}
        outputs: dict[str, list] = {}
        for rep in range(a.repeat):
            for name in systems:  # interleaved
                which, kw = SYSTEMS[name]
                opts = decode_options(max_batch_size=bs, **kw)
                t0 = time.perf_counter()
                res = models[which].translate_batch(src[:n], opts)
                times[name].append(time.perf_counter() - t0)
                outputs[name] = res
                print(f"bs {bs} rep {rep} {name}: {n / times[name][-1]:.1f} sent/s", flush=True)
        row = {}
        base = n / statistics.median(times["single greedy"]) if "single greedy" in times else None
        for name in systems:
            which, kw = SYSTEMS[name]
            res = outputs[name]
            if n < len(src):  # quality on the whole set, decoded once at a large batch
                res = res + models[which].translate_batch(src[n:], decode_options(max_batch_size=64, **kw))
            hyps = [r.text for r in res]
            rate = n / statistics.median(times[name])
            row[name] = {
                "sentences_per_s": round(rate, 2),
                "speedup_vs_single_greedy": round(rate / base, 3) if base else None,
                "times_s": [round(t, 3) for t in times[name]],
                "calls_per_sentence": round(statistics.mean(r.stats.iterations for r in res), 2),
                "output_tokens_per_sentence": round(statistics.mean(len(r.tokens) for r in res), 2),
                "bleu": round(bleu.corpus_score(hyps, [ref]).score, 2),
                "chrf": round(chrf.corpus_score(hyps, [ref]).score, 2),
            }
        results["batch_sizes"][str(bs)] = row
        print(json.dumps({bs: {k: (v["sentences_per_s"], v["speedup_vs_single_greedy"], v["bleu"]) for k, v in row.items()}}),
              flush=True)
    results["signatures"] = {"bleu": str(bleu.get_signature()), "chrf": str(chrf.get_signature())}
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
