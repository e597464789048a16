"""aggdec's benchmarks, one command: `python -m bench SUBCOMMAND ...` from the repository's root.

    compare     systems (aggdec's methods and precisions, CTranslate2, transformers, fairseq-generate)
                x models x batch sizes, each system in a process of its own
    contention  the same systems quiet and beside N competing compute processes
    host        host work per decoder call on a tiny model: eager and compiled steps
    roofline    the most sentences/s batch-1 greedy can reach in fp32 here, and systems' shares of it
    trees       aggdec's methods from this tree and another (a worktree of main): identity, speed
    ops         aten operators a verifier call dispatches, this tree against another
    gpu         the decode engine on a GPU: identity, captures, throughput, transformers, DecodeWorker
    jobs        corpus jobs on Ray against in-process decoding
    hash        a job's input check: units' slices hashed as decode actors hash them, against a decode rate
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
    from bench import compare, gpu, host, pipeline, trees

    p = sub.add_parser("compare", help="systems x models x batch sizes")
    compare.add_arguments(p, "greedy,iad,ct2")
    p.set_defaults(func=compare.compare)
    p = sub.add_parser("contention", help="systems quiet and beside competing processes")
    compare.add_arguments(p, "greedy,ct2")
    p.add_argument("--competitors", type=int, default=1, help="how many competing processes")
    p.add_argument("--competitor-threads", type=int, default=2, help="threads of each competing process")
    p.set_defaults(func=compare.contention)
    for name, module, about in (("host", host, "host work per decoder call (tiny model)"),
                                ("trees", trees, "aggdec's methods from two source trees"),
                                ("gpu", gpu, "the decode engine on a GPU"),
                                ("jobs", pipeline, "corpus jobs on Ray against in-process decoding")):
        p = sub.add_parser(name, help=about)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
    p = sub.add_parser("roofline", help="the batch-1 fp32 ceiling, and systems' shares of it")
    host.add_roofline_arguments(p)
    p.set_defaults(func=host.roofline)
    p = sub.add_parser("ops", help="operators per verifier call, two source trees")
    trees.add_ops_arguments(p)
    p.set_defaults(func=trees.ops)
    p = sub.add_parser("hash", help="the input check's hashing against a decode rate")
    pipeline.add_hash_arguments(p)
    p.set_defaults(func=pipeline.hash_inputs)
    p = sub.add_parser("table", help="a results file as a markdown table, or the marked tables of documents")
    p.add_argument("file", type=Path, nargs="?", help="a results file: print its table")
    p.add_argument("--systems", default=None, help="only these systems, in this order")
    p.add_argument("--update", type=Path, nargs="+", default=[], metavar="DOC",
                   help="rewrite the marked tables of these markdown files (bench/record.py, `update`)")
    p.set_defaults(func=print_table)
    a = ap.parse_args(argv)
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"python -m bench {a.command}: error: {e}", file=sys.stderr)
        return 2


def print_table(a: argparse.Namespace) -> int:
    from bench.record import load, table, update

    if a.file:
        print(table(load(a.file), a.systems.split(",") if a.systems else None))
    for doc in a.update:
        for path in update(doc):
            print(f"{doc}: {path} is not there yet; its table is left as it was", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
