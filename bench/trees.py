"""`trees`: aggdec's methods from two source trees (this one and `--other`, e.g. a worktree of main),
each tree's system in a process of its own: whether the outputs are token-identical, and, with
`--repeat` > 0, each tree's sentences/s (the median of the repeats, the two trees taking turns).

A system is named as in `compare` (bench/systems.py, aggdec's methods only: `greedy`, `iad+compile`,
`gad:models/ende-base`, ...); both trees run it on the same sentences, batch sizes and options.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

from bench.compare import aggdec_options
from bench.record import REPO
from bench.systems import Process, System


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--other", type=Path, required=True, help="the other source tree (a worktree of main)")
    ap.add_argument("--model", default="models/gec-base", help="default model of the systems")
    ap.add_argument("--data", type=Path, required=True, help="a TSV file with a header line")
    ap.add_argument("--column", default="noisy", help="the source column")
    ap.add_argument("--systems", default="greedy,iad,beam", help="comma-separated aggdec systems")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--limit", type=int, default=200, help="first N sentences")
    ap.add_argument("--repeat", type=int, default=0, help="timed repeats (0: outputs only, one run each)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--drafter", default="models/ende-base-draft-head", help="gad and gad++'s draft head")
    ap.add_argument("--heads", default="models/ende-base-heads", help="blockwise's proposal heads")
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE", help="an option of every system")


def job(a: argparse.Namespace, system: System, sources: list[str]) -> dict[str, Any]:
    """What both trees' processes of `system` run (bench/systems.py, `aggdec_runner`)."""
    return {"kind": "aggdec", "threads": system.threads or a.threads, "device": a.device, "beam": 1,
            "options": aggdec_options(a, system),
            "model": str(Path(system.model or a.model).resolve()), "inputs": sources}


def main(a: argparse.Namespace) -> int:
    from aggdec.train.ar import read_tsv

    systems = [System.parse(s) for s in a.systems.split(",") if s]
    if any(s.kind != "aggdec" for s in systems):
        raise ValueError("--systems: trees compares aggdec's methods only")
    other = a.other.resolve()
    if not (other / "aggdec").is_dir():
        raise ValueError(f"--other {a.other}: not an aggdec source tree")
    sources = [s for s in read_tsv(a.data, a.column, a.column)[0] if s.strip()][: a.limit]
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"aggdec-trees-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    differ = 0
    try:
        for i, system in enumerate(systems):
            path = work / f"job-{i}.json"
            path.write_text(json.dumps(job(a, system, sources)))
            trees = {"this": REPO, "other": other}
            procs = {name: Process(system, path, system.threads or a.threads, tree) for name, tree in trees.items()}
            try:
                for bs in sizes:
                    replies: dict[str, list[dict]] = {name: [] for name in trees}
                    for _ in range(max(1, a.repeat)):
                        for name, proc in procs.items():
                            reply = proc.request(bs, len(sources))
                            if "error" in reply:
                                raise RuntimeError(f"{system.name} bs {bs} ({name} tree): {reply['error']}")
                            replies[name].append(reply)
                    outs = {name: r[0]["outputs"] for name, r in replies.items()}
                    same = sum(x == y for x, y in zip(outs["this"], outs["other"]))
                    differ += same != len(sources)
                    line = f"{system.name} bs {bs}: {same}/{len(sources)} identical"
                    if a.repeat:
                        rate = {name: len(sources) / statistics.median(x["seconds"] for x in r)
                                for name, r in replies.items()}
                        line += (f"; this {rate['this']:.1f} sentences/s, other {rate['other']:.1f}, "
                                 f"ratio {rate['this'] / rate['other']:.3f}")
                    print(line, flush=True)
            finally:
                for proc in procs.values():
                    proc.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if differ else 0

