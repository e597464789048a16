"""GEC models on learner-like English: BLEU against the corrections and ERRANT F0.5, with the
unchanged input as a baseline.

    python bench/gec_learner_eval.py --models models/gec-base runs/gec-new --out bench/results/gec-learner.json

Sets (TSV, columns noisy / clean): `bench/data/learner-dev.tsv` (hand-written learner sentences),
`bench/data/learner-gen-dev.tsv` (held-out generated learner errors) and `../shared/data/gec/test.tsv`
when present. Decoding: `Translator.translate_batch(method="greedy")`, fp32, batch 64 (the CLI's
defaults). BLEU: sacrebleu defaults (13a). ERRANT: `aggdec.evaluate.gec_scores` with spaCy
tokenisation (the sets mix tokenised and untokenised text); needs the `gec` extra. Hypotheses are
written to runs/eval/<model>.<set>.hyp (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aggdec.api import Translator  # noqa: E402
from aggdec.evaluate import bleu_chrf, gec_scores  # noqa: E402
from aggdec.train.ar import read_tsv  # noqa: E402

SETS = {"learner-dev": ROOT / "bench" / "data" / "learner-dev.tsv",
        "learner-gen-dev": ROOT / "bench" / "data" / "learner-gen-dev.tsv",
        "gec-test": ROOT.parent / "shared" / "data" / "gec" / "test.tsv"}


def scores(src: list[str], hyps: list[str], refs: list[str], errant: bool) -> dict:
    b = bleu_chrf(hyps, refs)
    out = {"bleu": round(b["bleu"], 2), "bleu_signature": b["bleu_signature"],
           "exact_match": round(sum(h.split() == r.split() for h, r in zip(hyps, refs)) / len(refs), 4),
           "changed": sum(h.split() != s.split() for h, s in zip(hyps, src))}
    if errant:
        g = gec_scores(src, hyps, refs, tokenise=True)
        out.update({"errant_p": round(g["precision"], 4), "errant_r": round(g["recall"], 4),
                    "errant_f0.5": round(g["f0.5"], 4), "errant_tp_fp_fn": [g["tp"], g["fp"], g["fn"]],
                    "errant_signature": g["signature"]})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", required=True)
    p.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-errant", action="store_true", help="BLEU only (without the gec extra)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    res = {"machine": platform.machine(), "torch": torch.__version__, "threads": a.threads,
           "decoding": "greedy, fp32, batch 64 (Translator.translate_batch)", "sets": {}}
    translators = {m: Translator.load(m) for m in a.models}
    for name in a.sets:
        path = SETS[name]
        if not path.is_file():
            print(f"skip {name}: {path} not found")
            continue
        src, ref = read_tsv(path, "noisy", "clean")
        entry = {"path": str(path.relative_to(ROOT.parent)), "sentences": len(src),
                 "unchanged_refs": sum(s == r for s, r in zip(src, ref)),
                 "systems": {"input (no correction)": scores(src, src, ref, not a.no_errant)}}
        for m, tr in translators.items():
            t0 = time.perf_counter()
            hyps = [r.text for r in tr.translate_batch(src, method="greedy", max_batch_size=64)]
            sec = time.perf_counter() - t0
            out_dir = ROOT / "runs" / "eval"
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"{Path(m).name}.{name}.hyp").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
            entry["systems"][m] = {**scores(src, hyps, ref, not a.no_errant), "weights_sha": tr.bundle.sha,
                                   "seconds": round(sec, 2)}
        res["sets"][name] = entry
        for sysname, s in entry["systems"].items():
            print(f"{name:16s} {sysname:28s} BLEU {s['bleu']:6.2f}  F0.5 {s.get('errant_f0.5', float('nan')):.4f}"
                  f"  exact {s['exact_match']:.3f}  changed {s['changed']}", flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
