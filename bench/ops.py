"""`ops`: aten operators dispatched per verifier call, this tree against another (`--other`), each in a
process of its own: a measure of the eager CPU step's host work that other processes on the machine do
not disturb. Each option set (JSON, `decode_options`' fields) decodes the same sentences once to warm
up, then once counted (encoder included; calls are the loop's `Transformer.decode_hidden` and
`decode_slots` calls).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.record import REPO

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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--other", type=Path, required=True, help="the other source tree (a worktree of main)")
    ap.add_argument("--model", default="models/ende-base")
    ap.add_argument("--data", type=Path, required=True, help="a TSV file with a header line")
    ap.add_argument("--column", default="en", help="the source column")
    ap.add_argument("--limit", type=int, default=24, help="first N sentences")
    ap.add_argument("--options", action="append", required=True, metavar="JSON",
                    help='an option set, e.g. \'{"method": "iad", "max_batch_size": 8, "draft_length": "max"}\'')


def main(a: argparse.Namespace) -> int:
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
