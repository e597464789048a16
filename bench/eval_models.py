"""Evaluate the reference models on their test splits with the project's batched greedy decoding.

    python bench/eval_models.py [--models models/gec-base models/ende-base] [--batch 64] [--threads 2]

gec-*:  corpus BLEU of the hypotheses vs `clean`, of the noisy input itself vs `clean` (the
        do-nothing baseline), exact-match rates, and how often unchanged inputs stay unchanged.
ende-*: corpus BLEU and chrF vs `de`.
Decoding: DraftVerifyLoop (greedy, no drafts), fp32, batch 64. Writes bench/results/models.json and
the hypotheses to runs/eval/<model>.test.hyp (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import sacrebleu
import torch
from sacrebleu.metrics import BLEU, CHRF

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aggdec import checkpoint  # noqa: E402
from aggdec.decoding.loop import DraftVerifyLoop  # noqa: E402
from aggdec.decoding.metadata import Request  # noqa: E402
from aggdec.train.ar import read_tsv  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TASKS = {"gec": ("gec", "noisy", "clean"), "ende": ("ende", "en", "de")}
MAX_LEN = 200


def task_of(model_dir: Path) -> str:
    for t in TASKS:
        if model_dir.name.startswith(t):
            return t
    raise ValueError(f"{model_dir}: cannot tell the task from the name (expected gec-* or ende-*)")


def decode(bundle, sources: list[str], batch: int) -> tuple[list[str], float, int]:
    """Greedy-decode `sources` -> (hypotheses in input order, seconds, generated tokens)."""
    cfg = bundle.model.cfg
    reqs = []
    for i, s in enumerate(sources):
        ids = bundle.src_tok.encode(s)[: cfg.max_source_positions - 1] + [cfg.eos]
        max_len = min(max(MAX_LEN, 2 * len(ids) + 10), cfg.max_target_positions - 1)
        reqs.append(Request(index=i, src=ids, max_len=max_len))
    t0 = time.perf_counter()
    hyps = list(DraftVerifyLoop(bundle.model, max_batch_size=batch).run(reqs))
    seconds = time.perf_counter() - t0
    hyps.sort(key=lambda h: h.index)
    return [bundle.tgt_tok.decode(h.tokens) for h in hyps], seconds, sum(len(h.tokens) for h in hyps)


def evaluate(model_dir: Path, batch: int, limit: int | None) -> dict:
    task = task_of(model_dir)
    sub, s_col, t_col = TASKS[task]
    test = DATA / sub / "test.tsv"
    src, ref = read_tsv(test, s_col, t_col)
    if limit:
        src, ref = src[:limit], ref[:limit]
    bundle = checkpoint.load(model_dir, dtype=torch.float32)
    hyps, seconds, ntok = decode(bundle, src, batch)
    out_dir = ROOT / "runs" / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{model_dir.name}.test.hyp").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")

    bleu = BLEU()
    res = {
        "model": str(model_dir.relative_to(ROOT) if model_dir.is_relative_to(ROOT) else model_dir),
        "task": task, "test": str(test), "sentences": len(src), "columns": [s_col, t_col],
        "weights_sha": bundle.sha,
        "params": sum(p.numel() for p in bundle.model.parameters()),
        "files_bytes": {p.name: p.stat().st_size for p in sorted(model_dir.iterdir()) if p.is_file()},
        "train_meta": {k: bundle.meta.get(k) for k in ("recipe", "updates", "epochs", "minutes", "valid_loss", "valid_nll")},
        "decoding": {"method": "greedy (DraftVerifyLoop, no drafts)", "batch": batch, "dtype": "float32",
                     "threads": torch.get_num_threads(), "seconds": round(seconds, 2), "output_tokens": ntok,
                     "max_len": f"min(max({MAX_LEN}, 2*len(src)+10), max_target_positions-1)"},
        "bleu": round(bleu.corpus_score(hyps, [ref]).score, 2),
        "bleu_signature": str(bleu.get_signature()),
    }
    if task == "gec":
        res["bleu_noisy_source"] = round(BLEU().corpus_score(src, [ref]).score, 2)
        res["exact_match"] = round(sum(h == r for h, r in zip(hyps, ref)) / len(ref), 4)
        res["exact_match_noisy_source"] = round(sum(s == r for s, r in zip(src, ref)) / len(ref), 4)
        unchanged = [i for i, (s, r) in enumerate(zip(src, ref)) if s == r]
        res["unchanged_inputs"] = len(unchanged)
        res["unchanged_inputs_kept"] = round(sum(hyps[i] == src[i] for i in unchanged) / max(len(unchanged), 1), 4)
        changed = [i for i in range(len(src)) if src[i] != ref[i]]
        res["changed_inputs_fixed_exactly"] = round(sum(hyps[i] == ref[i] for i in changed) / max(len(changed), 1), 4)
    else:
        chrf = CHRF()
        res["chrf"] = round(chrf.corpus_score(hyps, [ref]).score, 2)
        res["chrf_signature"] = str(chrf.get_signature())
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["models/gec-base", "models/ende-base"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit", type=int, default=None, help="first N test sentences only (smoke runs)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "models.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for m in args.models:
        d = Path(m)
        d = d if d.is_absolute() else ROOT / d
        r = evaluate(d, args.batch, args.limit)
        results.append(r)
        print(json.dumps(r, indent=2), flush=True)
    doc = {"command": "python bench/eval_models.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "host": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "sacrebleu": sacrebleu.__version__,
                    "python": platform.python_version()},
           "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
