"""`trees`: aggdec's methods from two source trees (this one and `--other`, e.g. a worktree of main),
each tree's system in a process of its own: whether the outputs are token-identical, and, with
`--repeat` > 0, each tree's sentences/s (the median of the repeats, the two trees taking turns).

A system is named as in `compare` (bench/systems.py, aggdec's methods only: `greedy`, `iad+compile`,
`gad:models/ende-base`, ...); both trees run it on the same sentences, batch sizes and options.

`ops`: aten operators dispatched per verifier call, this tree against another (`--other`), each in a
process of its own: a measure of the eager CPU step's host work that other processes on the machine do
not disturb. Each option set (JSON, `decode_options`' fields) decodes the same sentences once to warm
up, then once counted (encoder included; calls are the loop's `Transformer.decode_hidden` and
`decode_slots` calls).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
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


COUNT = """
import collections, json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from aggdec.api import Translator, decode_options
from aggdec.model.transformer import Transformer
from aggdec.train.ar import read_tsv

torch.set_num_threads(1)
model, data, column, n, configs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
sources = [s for s in read_tsv(data, column, column)[0] if s.strip()][:n]
tr = Translator.load(model)
calls, depth = [0], [0]
for name in ("decode_hidden", "decode_slots"):
    def counted(self, *a, _fn=getattr(Transformer, name), **k):
        calls[0] += depth[0] == 0  # decode_hidden calls itself where nothing is packed
        depth[0] += 1
        try:
            return _fn(self, *a, **k)
        finally:
            depth[0] -= 1
    setattr(Transformer, name, counted)

class Count(TorchDispatchMode):
    n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Count.n += 1
        return func(*args, **(kwargs or {}))

for cfg in configs:
    opts = decode_options(**cfg)
    tr.translate_batch(sources, opts)
    calls[0], Count.n = 0, 0
    with Count():
        res = tr.translate_batch(sources, opts)
    print(json.dumps({"ops": Count.n, "calls": calls[0], "outputs": [r.tokens for r in res]}), flush=True)
"""


def add_ops_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--other", type=Path, required=True, help="the other source tree (a worktree of main)")
    ap.add_argument("--model", default="models/ende-base")
    ap.add_argument("--data", type=Path, required=True, help="a TSV file with a header line")
    ap.add_argument("--column", default="en", help="the source column")
    ap.add_argument("--limit", type=int, default=24, help="first N sentences")
    ap.add_argument("--options", action="append", required=True, metavar="JSON",
                    help='an option set, e.g. \'{"method": "iad", "max_batch_size": 8, "draft_length": "max"}\'')


def ops(a: argparse.Namespace) -> int:
    configs = [json.loads(o) for o in a.options]
    counts = {}
    for name, tree in (("this", REPO), ("other", a.other.resolve())):
        # relative paths (drafters) from here; PYTHONSAFEPATH: the tree's code, not this folder's
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONSAFEPATH="1", OMP_NUM_THREADS="1")
        done = subprocess.run([sys.executable, "-c", COUNT, str(Path(a.model).resolve()), str(a.data), a.column,
                               str(a.limit), json.dumps(configs)], env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"counting in {tree} failed: {done.stderr.strip().splitlines()[-1:]}")
        counts[name] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    worse = 0
    for cfg, this, other in zip(configs, counts["this"], counts["other"]):
        per = {k: c["ops"] / max(c["calls"], 1) for k, c in (("this", this), ("other", other))}
        worse += per["this"] > per["other"]
        print(f"{json.dumps(cfg)}: {per['this']:.1f} ops a call here, {per['other']:.1f} there "
              f"({this['calls']} and {other['calls']} calls); outputs "
              f"{'identical' if this['outputs'] == other['outputs'] else 'DIFFER'}", flush=True)
    return 1 if worse else 0
