"""An imported Hugging Face model against transformers and CTranslate2, one run, side by side: greedy
on an OPUS-MT-shaped Marian model (6+6 layers, d512, 8 heads, FFN 2048, swish, the 58,101-token
vocabulary of opus-mt-en-de) at each batch size, each system in its own process (two OpenMP runtimes
in one process slow each other down), decode time only.

    python bench/hf_bench.py --data ../shared/data/ende/test.tsv --limit 256 --bs1-limit 32 \
        --out bench/results/hf-marian.json

The weights are random (no hub access here), so the figures are for timing only: every system
decodes to the length limit (`--max-new` tokens), which makes tokens/s the comparable figure. The
tokenizer is a sentencepiece model (up to 8,000 pieces) trained on the data's source side, padded with unused
tokens to the Marian vocabulary size. Identical share: outputs equal to transformers' token for token.
`aggdec-int8` and `aggdec-bf16` run our greedy at that verifier `precision` (not exact).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OPUS_MT = dict(vocab_size=58101, decoder_vocab_size=58101, d_model=512, encoder_layers=6, decoder_layers=6,
               encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
               max_position_embeddings=512, activation_function="swish", scale_embedding=True, pad_token_id=58100,
               eos_token_id=0, decoder_start_token_id=58100, forced_eos_token_id=0)
SYSTEMS = ("aggdec", "transformers", "ct2-float32", "ct2-int8")


def read_sources(path: Path, limit: int, column: str = "en") -> list[str]:
    """The first `limit` values of `column` of a TSV with a header line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    at = lines[0].split("\t").index(column)
    return [line.split("\t")[at] for line in lines[1: limit + 1]]


def build_model(out: Path, texts: list[str]) -> Path:
    """The OPUS-MT-shaped Marian directory with random weights and a sentencepiece tokenizer."""
    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(out / "spm"), vocab_size=8000, hard_vocab_limit=False,
                                   model_type="unigram", character_coverage=1.0, minloglevel=2, num_threads=2)
    sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.id_to_piece(i) not in ("<unk>", "<s>", "</s>")]
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    for i in range(len(vocab), OPUS_MT["vocab_size"] - 1):
        vocab[f"<unused{i}>"] = i
    vocab["<pad>"] = OPUS_MT["vocab_size"] - 1
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes((out / "spm.model").read_bytes())
    (out / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    torch.manual_seed(0)
    MarianMTModel(MarianConfig(**OPUS_MT, init_std=0.1)).save_pretrained(out)  # 0.02 gives one output for all
    MarianTokenizer(str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json")).save_pretrained(out)
    return out


def worker(system: str, model_dir: Path, texts: list[str], bs: int, max_new: int, threads: int) -> dict:
    """Decode `texts` at batch size `bs` with one system; -> {"seconds", "outputs": [[ids]]} in input order,
    outputs without the final eos, at most max_new - 1 tokens (then eos is forced)."""
    import torch

    torch.set_num_threads(threads)
    if system.startswith("aggdec"):
        from aggdec.api import Translator

        kw = dict(method="greedy", precision=system.split("-", 1)[1] if "-" in system else "fp32")
        tr = Translator.load(model_dir)
        tr.translate_batch(texts[:2], **kw)  # warm-up
        t0 = time.perf_counter()
        res = tr.translate_batch(texts, max_batch_size=bs, max_len_a=0, max_len_b=max_new - 1, **kw)
        return {"seconds": time.perf_counter() - t0, "outputs": [r.tokens for r in res]}
    from transformers import MarianTokenizer

    tok = MarianTokenizer.from_pretrained(model_dir)
    ids = [tok(t).input_ids for t in texts]
    order = sorted(range(len(texts)), key=lambda i: len(ids[i]))  # length-sorted batches for every system
    outputs: dict[int, list[int]] = {}
    if system == "transformers":
        from transformers import MarianMTModel

        model = MarianMTModel.from_pretrained(model_dir).eval()
        with torch.inference_mode():
            model.generate(**tok(texts[:2], return_tensors="pt", padding=True), max_new_tokens=4)  # warm-up
            t0 = time.perf_counter()
            for start in range(0, len(order), bs):
                batch = order[start: start + bs]
                enc = tok([texts[i] for i in batch], return_tensors="pt", padding=True)
                gen = model.generate(**enc, num_beams=1, do_sample=False, max_new_tokens=max_new)
                for i, row in zip(batch, gen.tolist()):
                    row = [t for t in row[1:] if t != tok.pad_token_id]
                    outputs[i] = row[:-1] if row and row[-1] == tok.eos_token_id else row
        seconds = time.perf_counter() - t0
    else:
        import ctranslate2

        ct2_dir = model_dir.parent / "ct2"
        if not (ct2_dir / "model.bin").is_file():
            ctranslate2.converters.TransformersConverter(str(model_dir)).convert(str(ct2_dir), force=True)
        compute = system.split("-", 1)[1]
        tr = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=compute, inter_threads=1,
                                    intra_threads=threads)
        pieces = [tok.convert_ids_to_tokens(x) for x in ids]
        tr.translate_batch(pieces[:2], beam_size=1, max_decoding_length=4)  # warm-up
        t0 = time.perf_counter()
        res = tr.translate_batch([pieces[i] for i in order], beam_size=1, max_batch_size=bs,
                                 max_decoding_length=max_new - 1)
        seconds = time.perf_counter() - t0
        for i, r in zip(order, res):
            outputs[i] = tok.convert_tokens_to_ids(r.hypotheses[0])
    return {"seconds": seconds, "outputs": [outputs[i] for i in range(len(texts))]}


def identical(a: list[list[int]], b: list[list[int]], n: int) -> float:
    """Share of rows whose first n tokens agree (both systems stop at the limit or at the same eos)."""
    return sum(x[:n] == y[:n] for x, y in zip(a, b)) / max(1, len(a))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="TSV with a header line")
    ap.add_argument("--column", default="en", help="the source column")
    ap.add_argument("--limit", type=int, default=256)
    ap.add_argument("--bs1-limit", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--max-new", type=int, default=32, help="tokens per output incl. the forced eos")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="runs per system and batch size, interleaved; median time")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "aggdec-hf-bench")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bs", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    texts = read_sources(a.data, a.limit, a.column)
    model_dir = a.work / "opus-mt-shaped"
    if a.worker:
        n = a.limit
        print(json.dumps(worker(a.worker, model_dir, texts[:n], a.bs, a.max_new, a.threads)))
        return 0
    build_model(model_dir, read_sources(a.data, 5000, a.column))
    runs: dict[tuple[str, int], list[dict]] = {}
    systems = a.systems.split(",")
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    for _ in range(a.repeat):
        for bs in sizes:
            n = a.bs1_limit if bs == 1 else a.limit
            for system in systems:
                cmd = [sys.executable, __file__, "--data", str(a.data), "--column", a.column, "--limit", str(n),
                       "--max-new", str(a.max_new),
                       "--threads", str(a.threads), "--work", str(a.work), "--worker", system, "--bs", str(bs)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
                runs.setdefault((system, bs), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"{system} bs={bs}: {runs[(system, bs)][-1]['seconds']:.2f}s", file=sys.stderr)
    rows = []
    for bs in sizes:
        n = a.bs1_limit if bs == 1 else a.limit
        ref = runs.get(("transformers", bs), [{}])[0].get("outputs")
        for system in systems:
            rs = runs[(system, bs)]
            secs = statistics.median(r["seconds"] for r in rs)
            toks = sum(len(o) + 1 for o in rs[0]["outputs"])
            rows.append({"system": system, "batch_size": bs, "sentences": n, "seconds": round(secs, 3),
                         "sentences_per_s": round(n / secs, 2), "tokens_per_s": round(toks / secs, 1),
                         "distinct_outputs": len({tuple(o) for o in rs[0]["outputs"]}),
                         "identical_to_transformers": None if ref is None else round(
                             identical(rs[0]["outputs"], ref, a.max_new - 1), 4)})
        base = {r["system"]: r for r in rows if r["batch_size"] == bs}
        for r in rows:
            if r["batch_size"] == bs and "transformers" in base:
                r["speedup_vs_transformers"] = round(base["transformers"]["seconds"] / r["seconds"], 2)
    for r in rows:
        print(json.dumps(r))
    if a.out:
        import platform

        import torch

        a.out.write_text(json.dumps({
            "command": "python bench/hf_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": "Marian, opus-mt-en-de shape (6+6 layers, d512, vocab 58101), random weights: timing only",
            "cpu": platform.processor() or platform.machine(), "threads": a.threads, "torch": torch.__version__,
            "max_new_tokens": a.max_new, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
