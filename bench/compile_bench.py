"""Where a compiled step pays: the compiled slot loop against the eager row loop, in one process.

    python bench/compile_bench.py --model ende-base --batch-sizes 1,8,16,64,256 --limit 600 \
        --out bench/results/compile-ende.json
    python bench/compile_bench.py --model gec-base --batch-sizes 1 --method iad --limit 500

For each batch size: both loops decode the first `--limit` sentences of the model's test set
(gec-base: gec/test.tsv `noisy`; ende-base: ende/test.tsv `en`) with the method's default options
(IAD: the registry's drafter and draft budget), after a warm-up that compiles,
`--repeat` times interleaved; prints median sentences/s of each, their ratio and the share of
identical outputs; `--out` also writes them as JSON.
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

from aggdec.decoding.limits import max_len_for  # noqa: E402
from aggdec.decoding.loop import DraftVerifyLoop  # noqa: E402
from aggdec.decoding.metadata import Request  # noqa: E402
from aggdec.decoding.methods import decode_options, get_method, new_budget, wants_budget  # noqa: E402
from aggdec.decoding.slot_loop import SlotLoop  # noqa: E402
from aggdec.model.precision import cpu_isa  # noqa: E402
from tree_compare import add_test_set, open_test_set  # noqa: E402  (bench/ is this script's directory)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_test_set(ap, 500)
    ap.add_argument("--method", choices=("greedy", "iad"), default="greedy")
    ap.add_argument("--batch-sizes", default="1,8,16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sources, tr = open_test_set(a)
    opts = decode_options(a.method)
    framing = tr.framing(opts)
    reqs = []
    for i, s in enumerate(sources):
        ids = tr.prepare(s, framing)[0]
        reqs.append(Request(index=i, src=ids, max_len=max(1, max_len_for(len(ids), opts.max_len_a, opts.max_len_b,
                                                                           tr.cfg.max_target_positions))))
    method, context = get_method(a.method), tr._context(opts)

    def parts() -> dict:
        """The method's drafter and draft budget with its default options, as the registry builds them."""
        drafter = method.drafter(opts, context)
        return {"drafter": drafter, "budget": new_budget(drafter) if wants_budget(opts, drafter) else None}

    rows = []
    with torch.no_grad():
        for bs in (int(x) for x in a.batch_sizes.split(",")):
            loops = {"eager": DraftVerifyLoop(tr.model, max_batch_size=bs, projection=context.projection, **parts()),
                     "compiled": SlotLoop(tr.model, max_batch_size=bs, compile=True, **parts())}
            for loop in loops.values():
                list(loop.run(reqs[: max(2 * bs, 8)]))  # warm-up; compiles
            seconds: dict[str, list[float]] = {k: [] for k in loops}
            outs: dict[str, dict[int, list[int]]] = {}
            for _ in range(a.repeat):
                for kind, loop in loops.items():
                    t0 = time.perf_counter()
                    outs[kind] = {h.index: h.tokens for h in loop.run(reqs)}
                    seconds[kind].append(time.perf_counter() - t0)
            rate = {k: len(reqs) / statistics.median(v) for k, v in seconds.items()}
            same = sum(outs["eager"][i] == outs["compiled"][i] for i in outs["eager"]) / len(reqs)
            rows.append({"model": a.model, "method": a.method, "batch_size": bs, "sentences": len(reqs),
                         "eager_sentences_per_s": round(rate["eager"], 2),
                         "compiled_sentences_per_s": round(rate["compiled"], 2),
                         "ratio": round(rate["compiled"] / rate["eager"], 3), "identical": same})
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        a.out.write_text(json.dumps({"command": "python bench/compile_bench.py " + " ".join(argv or sys.argv[1:]),
                                     "cpu": cpu_isa(), "threads": a.threads, "torch": torch.__version__,
                                     "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
