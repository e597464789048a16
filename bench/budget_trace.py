"""Where a draft budget spends its calls: one decode run, its calls counted by draft length.

    python bench/budget_trace.py --model models/ende-base --data ../shared/data/ende/test.tsv \
        --column en --method gad --drafter models/ende-base-draft-head --batch-size 128

Decodes the sentences once after a 16-sentence warm-up (as bench/bulk_bench.py does) and prints
sentences/s, then per draft length the calls, output tokens, seconds and tokens/s of the loop
iterations the budget measured, and the calls at which its choice changed; `--calls` also each
drafting call (a first call at a new length pays first-use costs). `--fixed-length 0` holds every
call at that length instead (the loop's cost without exploring).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from aggdec.api import Translator
from aggdec.decoding import budget
from aggdec.train.ar import read_tsv


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/ende-base")
    ap.add_argument("--data", default="../shared/data/ende/test.tsv")
    ap.add_argument("--column", default="en")
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--method", default="gad")
    ap.add_argument("--drafter", default="models/ende-base-draft-head")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--fixed-length", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", action="store_true", help="also print every drafting call (length > 0)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    calls: list[tuple[int, int, float, int]] = []  # (length, tokens, seconds, choice after the call)
    record = budget.DraftBudget.record

    def traced(self, length, tokens, seconds, rows=1, offered=None):
        record(self, length, tokens, seconds, rows, offered)
        calls.append((length, tokens, seconds, self.choice))

    budget.DraftBudget.record = traced
    if a.fixed_length is not None:
        budget.DraftBudget.next_length = lambda self, rows, limit: min(a.fixed_length, limit)
    sents = read_tsv(a.data, a.column, a.column)[0][: a.limit]
    tr = Translator.load(a.model)
    kw = dict(method=a.method, max_batch_size=a.batch_size)
    if a.method not in ("iad", "greedy"):
        kw["drafter"] = a.drafter
    tr.translate_batch(sents[:16], **kw)
    calls.clear()
    t0 = time.perf_counter()
    tr.translate_batch(sents, **kw)
    print(f"{a.method} batch {a.batch_size}: {len(sents) / (time.perf_counter() - t0):.1f} sentences/s")
    by_length = defaultdict(lambda: [0, 0, 0.0])
    for length, tokens, seconds, _ in calls:
        row = by_length[length]
        row[0], row[1], row[2] = row[0] + 1, row[1] + tokens, row[2] + seconds
    for length, (n, tokens, seconds) in sorted(by_length.items()):
        print(f"length {length}: {n} calls, {tokens} tokens, {seconds:.2f} s, {tokens / seconds:.0f} tokens/s")
    changes = [(i, c[3]) for i, c in enumerate(calls) if i == 0 or c[3] != calls[i - 1][3]]
    print("choice (call, length):", changes)
    if a.calls:
        for i, (length, tokens, seconds, _) in enumerate(calls):
            if length:
                print(f"call {i}: length {length}, {tokens} tokens, {1000 * seconds:.1f} ms")


if __name__ == "__main__":
    main()
