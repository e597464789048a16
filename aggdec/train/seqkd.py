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
from aggdec.distill import TSV_HEADER, PairFilter, filter_reasons, pair_lines
from aggdec.schema import decoded_columns
from aggdec.train.ar import log, read_tsv
from aggdec.train.args import seqkd_args


def generate(model_dir: str | Path, sources: list[str], out_tsv: str | Path, *, method: str = "greedy",
             batch_size: int = 64, chunk: int = 2048, device: str = "cpu", keep: PairFilter | None = None) -> int:
    """Decode `sources` and write the (src, kd) pairs that `keep` (default: PairFilter()) keeps, as
    distill jobs do (aggdec.distill); returns pairs written."""
    tr = Translator.load(model_dir, device=device)
    opts = decode_options(method, max_batch_size=batch_size)
    keep = keep or PairFilter()
    written = 0
    t0 = time.time()
    with open(out_tsv, "wb") as f:
        f.write(TSV_HEADER.encode("utf-8"))
        for start in range(0, len(sources), chunk):
            part = sources[start : start + chunk]
            table = pa.table({"src": part, **decoded_columns(tr.translate_batch(part, opts))})
            kept = filter_reasons(table, keep) == ""
            f.write(pair_lines(table, kept))
            written += int(kept.sum())
            log(f"seqkd {start + len(part)}/{len(sources)} ({(start + len(part)) / (time.time() - t0):.1f} sent/s)")
    return written


def main(argv: list[str] | None = None) -> int:
    """Command-line entry (flags: aggdec.train.args.seqkd_args); returns 0 once the pairs are written."""
    return run(seqkd_args(argv))


def run(a: argparse.Namespace) -> int:
    """Write the Seq-KD pairs that `a` (seqkd_args) asks for; returns 0."""
    torch.set_num_threads(a.threads)
    src, _ = read_tsv(a.data, a.column, a.column)
    if a.limit:
        src = src[: a.limit]
    n = generate(a.model, src, a.out, method=a.method, batch_size=a.batch_size, device=a.device)
    log(f"wrote {n} pairs to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
