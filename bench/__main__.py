"""aggdec's benchmarks, one command: `python -m bench SUBCOMMAND ...` from the repository's root.

    compare     systems (aggdec's methods and precisions, CTranslate2, transformers, fairseq-generate)
                x models x batch sizes, each system in a process of its own
    contention  the same systems quiet and beside N competing compute processes
    host        host work per decoder call on a tiny model: the row loop against the slot loop
    gpu         the decode engine on a GPU: identity, captures, throughput, transformers, DecodeWorker
    jobs        corpus jobs on Ray against in-process decoding
    table       a results file as the markdown table docs/benchmarks.md shows

Every subcommand writes one results format (bench/record.py) with `--out`. Not a test: the tests
assert guarantees, these measure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    from bench import compare

    p = sub.add_parser("compare", help="systems x models x batch sizes")
    compare.add_arguments(p, "greedy,iad,ct2")
    p.set_defaults(func=compare.compare)
    p = sub.add_parser("contention", help="systems quiet and beside competing processes")
    compare.add_arguments(p, "greedy,ct2")
    p.add_argument("--competitors", type=int, default=1, help="how many competing processes")
    p.add_argument("--competitor-threads", type=int, default=2, help="threads of each competing process")
    p.set_defaults(func=compare.contention)
    p = sub.add_parser("table", help="a results file as a markdown table")
    p.add_argument("file", type=Path)
    p.set_defaults(func=print_table)
    a = ap.parse_args(argv)
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"python -m bench {a.command}: error: {e}", file=sys.stderr)
        return 2


def print_table(a: argparse.Namespace) -> int:
    from bench.record import load, table

    print(table(load(a.file)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
