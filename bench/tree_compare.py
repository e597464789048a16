"""Two source trees side by side on real models: sentences/s and identical outputs, one run.

    git worktree add --detach ../aggdec-base <commit>
    python bench/tree_compare.py --base ../aggdec-base --runs ende-base:beam:64,gec-base:iad:1 \
        --limit 256 --repeat 3 --out bench/results/tree-compare.json

Each run `model:method:batch_size[:flag+flag...]` decodes the first `--limit` sentences of the
model's test set (gec-base: gec/test.tsv `noisy`; ende-base: ende/test.tsv `en`; `--data` names
their folder) through the public API (`Translator.translate_batch`, default options but the method,
its batch size and, for gad, gad++ and blockwise, the shipped drafter), once per tree and repeat,
interleaved, each in its own process: the engine is imported from that tree, the model files come
from this one, so only the code differs. Flags are boolean options set in this tree's runs only
(`gec-base:greedy:1:compile`: this tree compiled against the base tree's default); `name=value`
items set an option in both trees' runs (`ende-base:gad++:64:draft_length=max`, the setting under
which a lossy method's output does not depend on timing). `--limit 0` decodes the whole set. Per run: the
median sentences/s of each tree (after a warm-up of 8 sentences or two batches), their ratio, and
the share of sentences whose output tokens are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aggdec.api import Translator

REPO = Path(__file__).resolve().parent.parent
SETS = {"gec-base": ("gec/test.tsv", "noisy"), "ende-base": ("ende/test.tsv", "en"),
        "ende-base-double-token": ("ende/test.tsv", "en")}
DRAFTERS = {"gad": "ende-base-draft-head", "gad++": "ende-base-draft-head", "blockwise": "ende-base-heads"}


def add_test_set(ap: argparse.ArgumentParser, limit: int, model: bool = True) -> None:
    """The options that pick the sentences (`test_sources`): `--model` (a shipped model with a test set;
    not where a script names models otherwise), `--data` (the folder of the test sets), `--limit`."""
    if model:
        ap.add_argument("--model", choices=("ende-base", "gec-base"), default="ende-base")
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--limit", type=int, default=limit, help="first N sentences (0: all)")


def open_test_set(a: argparse.Namespace) -> tuple[list[str], Translator]:
    """The sentences and the shipped model that the options of `add_test_set` picked."""
    from aggdec.api import Translator

    return test_sources(a.data, a.model, a.limit), Translator.load(str(REPO / "models" / a.model))


def test_sources(data: str, model: str, limit: int) -> list[str]:
    """The first `limit` source sentences (0: all) of `model`'s test set (`SETS`) in the folder `data`,
    read with the engine imported first (a worker's tree)."""
    from aggdec.train.ar import read_tsv

    path, column = SETS[model]
    return read_tsv(str(Path(data) / path), column, column)[0][: limit or None]


def worker(a: argparse.Namespace) -> None:
    """Decode in this process with the engine of `a.tree`; print one JSON line, write the tokens."""
    sys.path.insert(0, str(Path(a.tree).resolve()))
    import torch

    from aggdec.decoding.methods import options_from_mapping

    torch.set_num_threads(a.threads)
    sources, tr = open_test_set(a)
    table = {"method": a.method, "max_batch_size": a.batch_size}
    if a.method in DRAFTERS:
        table["drafter"] = str(REPO / "models" / DRAFTERS[a.method])
    for flag in filter(None, a.flags.split("+")):
        name, _, value = flag.partition("=")
        table[name] = value or "true"  # typed as a job spec's [decode] values are
    opts = options_from_mapping(table, a.method)[0]
    tr.translate_batch(sources[: max(2 * a.batch_size, 8)], opts)  # warm-up
    t0 = time.perf_counter()
    results = tr.translate_batch(sources, opts)
    seconds = time.perf_counter() - t0
    Path(a.tokens).write_text(json.dumps([r.tokens for r in results]))
    print(json.dumps({"sentences": len(sources), "seconds": seconds}))


def run_one(tree: str, model: str, method: str, bs: int, flags: str, a: argparse.Namespace, tokens: Path) -> float:
    cmd = [sys.executable, __file__, "--worker", "--tree", tree, "--model", model, "--method", method,
           "--batch-size", str(bs), "--flags", flags, "--limit", str(a.limit), "--data", a.data,
           "--threads", str(a.threads), "--tokens", str(tokens)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return row["sentences"] / row["seconds"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="the other source tree (a git worktree of the base commit); required")
    ap.add_argument("--runs", default="ende-base:greedy:1,ende-base:beam:64,gec-base:iad:1,gec-base:greedy:64")
    add_test_set(ap, 256, model=False)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    ap.add_argument("--flags", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    if not a.base:
        ap.error("--base is required")
    trees = {"base": str(Path(a.base).resolve()), "this": str(REPO)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in a.runs.split(","):
            model, method, bs, *flags = spec.split(":")
            flags = flags[0] if flags else ""
            shared = "+".join(f for f in flags.split("+") if "=" in f)  # options set in both trees
            speeds: dict[str, list[float]] = {k: [] for k in trees}
            for _ in range(a.repeat):
                for name, tree in trees.items():
                    speeds[name].append(run_one(tree, model, method, int(bs), flags if name == "this" else shared, a,
                                                Path(tmp) / f"{name}.json"))
            base, this = (json.loads((Path(tmp) / f"{k}.json").read_text()) for k in trees)
            row = {"model": model, "method": method, "batch_size": int(bs), "this_flags": flags, "sentences": len(base),
                   **{f"{k}_sentences_per_s": round(statistics.median(v), 2) for k, v in speeds.items()},
                   "all": {k: [round(x, 2) for x in v] for k, v in speeds.items()},
                   "identical": round(sum(x == y for x, y in zip(base, this)) / len(base), 4)}
            row["ratio"] = round(row["this_sentences_per_s"] / row["base_sentences_per_s"], 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        sys.path.insert(0, str(REPO))
        from aggdec.model.precision import cpu_isa

        base_commit = subprocess.run(["git", "-C", trees["base"], "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip()
        this_commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip()
        args = [f"<worktree of {base_commit}>" if x == a.base else x for x in (argv or sys.argv[1:])]
        a.out.write_text(json.dumps({"command": "python bench/tree_compare.py " + " ".join(args),
                                     "base": base_commit, "this": this_commit, "threads": a.threads,
                                     "cpu": platform.processor() or platform.machine(), "cpu_isa": cpu_isa(),
                                     "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
