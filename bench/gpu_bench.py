"""aggdec on one GPU, in one process: the slot loop (CUDA graphs) against the row loop, each method
of the shipped models, and transformers `generate` on the same GPU.

    python bench/gpu_bench.py --gec-data gec-test.tsv --ende-data ende-test.tsv \
        --out bench/results/gpu.json

- `gec-base` greedy and IAD (draft_cap 16, substitution, nearest_match; `draft_length` max and the
  draft budget) on the slot loop, and greedy/IAD on the row loop, at each batch size;
- `ende-base` greedy and GAD (the shipped draft head, k = 4, draft budget) on the slot loop and on the
  row loop; GAD and GAD++ (draft head, budget), blockwise, beam-5, and `ende-base-double-token` greedy
  through the API (the row loop for methods the slot loop does not take);
- `--hf`: transformers `generate` greedy on the OPUS-MT-shaped Marian model of bench/hf_bench.py
  (random weights, timing only, every output runs to `--max-new`) against our greedy on the imported model.

Per run: sentences/s, output tokens/s, verifier calls per sentence, identical share against fp32
greedy of the row loop on the CPU, and (slot loop) the first run's time, graph captures included.
`--busy` adds the share of wall time the GPU runs kernels (torch.profiler) for the slot loop.

The results file is rewritten after every row, so a run stopped at a device's time limit keeps what
it measured; a system that raises leaves a row with its `error` instead of figures, the others run,
and the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from aggdec.api import Translator  # noqa: E402
from aggdec.checkpoint import load_draft_head  # noqa: E402
from aggdec.decoding.budget import DraftBudget  # noqa: E402
from aggdec.decoding.drafters import NoDraft  # noqa: E402
from aggdec.decoding.gad_head import DraftHeadDrafter  # noqa: E402
from aggdec.decoding.iad import InputCopy  # noqa: E402
from aggdec.decoding.limits import max_len_for  # noqa: E402
from aggdec.decoding.loop import DraftVerifyLoop  # noqa: E402
from aggdec.decoding.metadata import Request  # noqa: E402
from aggdec.decoding.slot_loop import SlotLoop  # noqa: E402


def read_column(path: Path, column: str, limit: int) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    at = lines[0].split("\t").index(column)
    return [line.split("\t")[at] for line in lines[1: limit + 1]]


def requests(tr: Translator, texts: list[str]) -> list[Request]:
    cfg = tr.cfg
    out = []
    for i, t in enumerate(texts):
        ids = tr.prepare(t)[0]
        out.append(Request(index=i, src=ids, max_len=max(1, max_len_for(len(ids), 1.5, 10, cfg.max_target_positions))))
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> tuple[dict, float]:
    sync(device)
    t0 = time.perf_counter()
    hyps = fn()
    sync(device)
    return hyps, time.perf_counter() - t0


def busy_share(fn) -> float | None:
    """Share of fn's wall time in which GPU kernels ran (sum of kernel times / wall)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    us = sum(getattr(e, "device_time", 0.0) or getattr(e, "cuda_time", 0.0) for e in kernels)
    return round(us / 1e6 / wall, 3) if kernels else None


class Results:
    """The rows measured so far, printed as they come and written (whole) to `path` after each."""

    def __init__(self, path: Path | None, command: str, device: str):
        self.path, self.command, self.device, self.rows = path, command, device, []

    def add(self, r: dict) -> None:
        self.rows.append(r)
        print(json.dumps(r), flush=True)
        if self.path:
            self.path.write_text(json.dumps({"command": self.command, "device": self.device, "torch": torch.__version__,
                                             "rows": self.rows}, indent=2) + "\n")

    def attempt(self, system: str, bs: int | None, fn) -> None:
        """fn(), which adds its rows; if it raises, a row naming the error instead."""
        try:
            fn()
        except Exception as e:
            self.add({"system": system, "batch_size": bs, "error": f"{type(e).__name__}: {e}"[:500]})

    @property
    def failed(self) -> bool:
        return any("error" in r for r in self.rows)


def row(name: str, bs: int, hyps: dict, seconds: float, ref: dict | None, **extra) -> dict:
    n = len(hyps)
    toks = sum(len(h.tokens) + 1 for h in hyps.values())
    calls = [h.stats.iterations for h in hyps.values()]
    r = {"system": name, "batch_size": bs, "sentences": n, "seconds": round(seconds, 3),
         "sentences_per_s": round(n / seconds, 1), "tokens_per_s": round(toks / seconds, 1),
         "calls_per_sentence": round(statistics.mean(calls), 2) if calls else None}
    if ref is not None:
        r["identical_to_cpu_greedy"] = round(sum(hyps[i].tokens == ref[i] for i in hyps) / max(n, 1), 4)
    r.update(extra)
    return r


def loops(model, kind: str, bs: int):
    """name -> function building a fresh loop at batch size bs."""
    iad = lambda: InputCopy(max_draft=16, substitution=True, nearest_match=True)  # noqa: E731
    out = {"greedy-slots": lambda: SlotLoop(model, NoDraft(), max_batch_size=bs),
           "greedy-rows": lambda: DraftVerifyLoop(model, NoDraft(), max_batch_size=bs)}
    if kind == "gec":
        out |= {"iad-slots": lambda: SlotLoop(model, iad(), max_batch_size=bs),
                "iad-slots-budget": lambda: SlotLoop(model, iad(), max_batch_size=bs, budget=DraftBudget(16)),
                "iad-rows": lambda: DraftVerifyLoop(model, iad(), max_batch_size=bs)}
    if kind == "ende":  # GAD with the shipped draft head (k = 4) and the draft budget, on either loop
        head = load_draft_head(REPO / "models" / "ende-base-draft-head").to(next(model.parameters()).device)
        gad = lambda: DraftHeadDrafter(model, head, 4)  # noqa: E731
        out |= {"gad-slots-budget": lambda: SlotLoop(model, gad(), max_batch_size=bs, budget=DraftBudget(4)),
                "gad-rows-budget": lambda: DraftVerifyLoop(model, gad(), max_batch_size=bs, budget=DraftBudget(4))}
    return out


def bench_loops(results: Results, kind: str, model_dir: Path, texts: list[str], sizes: list[int], bs1_limit: int,
                device: str, systems: list[str] | None, busy: bool) -> None:
    cpu = Translator.load(model_dir)
    reqs = requests(cpu, texts)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    ref = {h.index: h.tokens for h in DraftVerifyLoop(cpu.model, NoDraft(), max_batch_size=64).run(reqs)}
    model = Translator.load(model_dir, device=device).model
    for bs in sizes:
        sub = reqs[:bs1_limit] if bs == 1 else reqs
        for name, make in loops(model, kind, bs).items():
            if systems and name not in systems:
                continue
            if bs >= 256 and name.endswith("-rows") and name != "greedy-rows":
                continue
            results.attempt(f"{kind}:{name}", bs, lambda: results.add(run_loop(f"{kind}:{name}", make(), bs, sub, ref,
                                                                                device, busy)))


def run_loop(system: str, loop, bs: int, sub: list[Request], ref: dict, device: str, busy: bool) -> dict:
    """One loop's row: its first run (captures included), then a timed one."""
    first_hyps, first = timed(lambda: {h.index: h for h in loop.run(sub)}, device)
    hyps, seconds = timed(lambda: {h.index: h for h in loop.run(sub)}, device)
    if isinstance(loop, SlotLoop):  # the second run captures again (a new slot cache): time a third
        hyps, seconds = timed(lambda: {h.index: h for h in loop.run(sub)}, device)
    extra = {"first_run_seconds": round(first, 3)}
    if isinstance(loop, SlotLoop):
        extra["graphs"] = len(loop._captured)
        if busy and device == "cuda" and bs >= 64:
            try:
                extra["gpu_busy"] = busy_share(lambda: list(loop.run(sub)))
            except Exception as e:  # the profiler is an extra: report, go on
                extra["gpu_busy_error"] = repr(e)[:200]
    return row(system, bs, hyps, seconds, ref, **extra)


def bench_api(results: Results, model_dir: Path, texts: list[str], sizes: list[int], bs1_limit: int, device: str,
              methods: list[tuple[str, dict]]) -> None:
    tr = Translator.load(model_dir, device=device)
    cpu = Translator.load(model_dir)
    ref_res = cpu.translate_batch(texts, method="greedy", max_batch_size=64)
    ref = {i: r.tokens for i, r in enumerate(ref_res)}
    for bs in sizes:
        sub = texts[:bs1_limit] if bs == 1 else texts
        for name, kw in methods:
            def run(name=name, kw=kw, bs=bs, sub=sub):
                tr.translate_batch(sub[:8], max_batch_size=bs, **kw)  # warm-up
                res, seconds = timed(lambda: tr.translate_batch(sub, max_batch_size=bs, **kw), device)
                hyps = {i: _Hyp(r.tokens, r.stats) for i, r in enumerate(res)}
                results.add(row(f"{model_dir.name}:{name}", bs, hyps, seconds, ref if "double" not in name else None))
            results.attempt(f"{model_dir.name}:{name}", bs, run)


class _Hyp:
    def __init__(self, tokens, stats):
        self.tokens, self.stats = tokens, stats


def bench_hf(results: Results, texts: list[str], sizes: list[int], max_new: int, device: str, work: Path) -> None:
    from hf_bench import build_model
    from transformers import MarianMTModel, MarianTokenizer

    model_dir = build_model(work / "opus-mt-shaped", texts[:5000])
    tok = MarianTokenizer.from_pretrained(model_dir)
    hf = MarianMTModel.from_pretrained(model_dir).to(device).eval()
    tr = Translator.load(model_dir, device=device)
    for bs in sizes:
        order = sorted(range(len(texts)), key=lambda i: len(tok(texts[i]).input_ids))
        outs: dict[int, list[int]] = {}

        def run_hf():
            with torch.inference_mode():
                for s in range(0, len(order), bs):
                    batch = order[s: s + bs]
                    enc = tok([texts[i] for i in batch], return_tensors="pt", padding=True).to(device)
                    gen = hf.generate(**enc, num_beams=1, do_sample=False, max_new_tokens=max_new)
                    for i, r in zip(batch, gen.tolist()):
                        r = [t for t in r[1:] if t != tok.pad_token_id]
                        outs[i] = r[:-1] if r and r[-1] == tok.eos_token_id else r

        run_hf()
        _, hf_s = timed(run_hf, device)
        kw = dict(method="greedy", max_batch_size=bs, max_len_a=0, max_len_b=max_new - 1)
        tr.translate_batch(texts, **kw)
        res, ours_s = timed(lambda: tr.translate_batch(texts, **kw), device)
        same = sum(r.tokens[: max_new - 1] == outs[i][: max_new - 1] for i, r in enumerate(res)) / len(texts)
        toks = sum(len(outs[i]) + 1 for i in outs)
        results.add({"system": "marian:transformers-generate", "batch_size": bs, "sentences": len(texts),
                     "seconds": round(hf_s, 3), "sentences_per_s": round(len(texts) / hf_s, 1),
                     "tokens_per_s": round(toks / hf_s, 1)})
        results.add({"system": "marian:aggdec-greedy", "batch_size": bs, "sentences": len(texts),
                     "seconds": round(ours_s, 3), "sentences_per_s": round(len(texts) / ours_s, 1),
                     "tokens_per_s": round(sum(len(r.tokens) + 1 for r in res) / ours_s, 1),
                     "identical_to_transformers": round(same, 4), "speedup_vs_transformers": round(hf_s / ours_s, 2)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gec-data", type=Path, help="TSV with a `noisy` column (gec/test.tsv)")
    ap.add_argument("--ende-data", type=Path, help="TSV with an `en` column (ende/test.tsv)")
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--repeat-data", type=int, default=1, help="repeat the sentences (batch 1024 wants more)")
    ap.add_argument("--bs1-limit", type=int, default=200)
    ap.add_argument("--batch-sizes", default="1,64,256,1024")
    ap.add_argument("--api-batch-sizes", default="1,64")
    ap.add_argument("--systems", default="", help="loop systems to run (default all)")
    ap.add_argument("--api-methods", default="gad,gad++,blockwise,beam,double-token")
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--hf-limit", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--busy", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--work", type=Path, default=Path("/tmp/aggdec-gpu-bench"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    systems = [s for s in a.systems.split(",") if s]
    models = REPO / "models"
    api = {"gad": dict(method="gad", drafter=str(models / "ende-base-draft-head")),
           "gad++": dict(method="gad++", drafter=str(models / "ende-base-draft-head")),
           "blockwise": dict(method="blockwise", drafter=str(models / "ende-base-heads")),
           "beam": dict(method="beam", beam=5)}
    chosen = [m for m in a.api_methods.split(",") if m]
    if unknown := set(chosen) - {*api, "double-token"}:
        ap.error(f"--api-methods: unknown {', '.join(sorted(unknown))}")
    api_sizes = [int(x) for x in a.api_batch_sizes.split(",")]
    device = torch.cuda.get_device_name() if a.device == "cuda" else platform.processor()
    results = Results(a.out, "python bench/gpu_bench.py " + " ".join(argv or sys.argv[1:]), device)
    if a.gec_data:
        texts = read_column(a.gec_data, "noisy", a.limit) * a.repeat_data
        results.attempt("gec", None, lambda: bench_loops(results, "gec", models / "gec-base", texts, sizes, a.bs1_limit,
                                                         a.device, systems, a.busy))
    if a.ende_data:
        texts = read_column(a.ende_data, "en", a.limit)
        results.attempt("ende", None, lambda: bench_loops(results, "ende", models / "ende-base", texts, sizes,
                                                          a.bs1_limit, a.device, systems, False))
        results.attempt("ende-base", None, lambda: bench_api(results, models / "ende-base", texts, api_sizes,
                                                             a.bs1_limit // 2, a.device,
                                                             [(m, api[m]) for m in chosen if m in api]))
        if "double-token" in chosen:
            results.attempt("ende-base-double-token", None, lambda: bench_api(
                results, models / "ende-base-double-token", texts, api_sizes, a.bs1_limit // 2, a.device,
                [("double-token-greedy", dict(method="greedy"))]))
        if a.hf:
            results.attempt("marian", 64, lambda: bench_hf(results, read_column(a.ende_data, "en", a.hf_limit), [64],
                                                           a.max_new, a.device, a.work))
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
