"""Seq-KD data: the verifier's own greedy (or beam) outputs on training sources, made with the
project's batched decoding. Output TSV columns: `src`, `kd` (header line, no quoting).

    python -m aggdec.train.seqkd --model models/ende-base --data ../shared/data/ende/train.tsv \
        --column en --out runs/ende-kd.tsv --limit 60000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pyarrow as pa
import torch

from aggdec.api import Translator, decode_options
from aggdec.distill import REASON_TEXT, TSV_HEADER, PairFilter, distill_table, merge_counts, pair_lines
from aggdec.schema import decoded_columns
from aggdec.train.ar import log, read_tsv
from aggdec.train.args import seqkd_args


def generate(model_dir: str | Path, sources: list[str], out_tsv: str | Path, *, method: str = "greedy",
             batch_size: int = 64, chunk: int = 2048, device: str = "cpu", keep: PairFilter | None = None) -> dict:
    """Decode `sources` and write the (src, kd) pairs that `keep` (default: PairFilter()) keeps, as
    distill jobs do (aggdec.distill); -> counts {"kept": n, "filtered": {reason: n}} (`distill_table`'s)."""
    tr = Translator.load(model_dir, device=device)
    opts = decode_options(method, max_batch_size=batch_size)
    keep = keep or PairFilter()
    counts = []
    t0 = time.time()
    with open(out_tsv, "wb") as f:
        f.write(TSV_HEADER.encode("utf-8"))
        for start in range(0, len(sources), chunk):
            part = sources[start : start + chunk]
            table, _, kept = distill_table(pa.table({"src": part, **decoded_columns(tr.translate_batch(part, opts))}),
                                           keep, tsv=False)
            f.write(pair_lines(table, table.column("kept").to_numpy(zero_copy_only=False)))
            counts.append(kept)
            log(f"seqkd {start + len(part)}/{len(sources)} ({(start + len(part)) / (time.time() - t0):.1f} sent/s)")
    return merge_counts(counts)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry (flags: aggdec.train.args.seqkd_args); returns 0 once the pairs are written."""
    return run(seqkd_args(argv))


def run(a: argparse.Namespace) -> int:
    """Write the Seq-KD pairs that `a` (seqkd_args) asks for; returns 0, or 1 with one line on stderr saying
    why each source was dropped where none was kept."""
    torch.set_num_threads(a.threads)
    src, _ = read_tsv(a.data, a.column, a.column)
    if a.limit:
        src = src[: a.limit]
    counts = generate(a.model, src, a.out, method=a.method, batch_size=a.batch_size, device=a.device)
    log(f"wrote {counts['kept']} pair{'' if counts['kept'] == 1 else 's'} to {a.out}")
    if counts["kept"] == 0:
        why = ", ".join(f"{n} {REASON_TEXT.get(r, r)}" for r, n in counts["filtered"].items()) or "no source"
        print(f"aggdec: seqkd kept no pair of {len(src)} sources: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
