"""Training data for `gec-base`: the gec corpus plus synthetic learner errors on clean English.

    python models/make_gec_data.py --data ../shared/data --out runs/gec-data [--copies 2] [--workers 8]

Writes `<out>/train.tsv` and `<out>/valid.tsv` (columns source, noisy, clean): the pairs of
`gec/train.tsv` as they are (but those whose clean side is held out, below), then `--copies` learner-error versions (aggdec.train.learner_errors,
seed 1) of every clean English sentence in the pool: the `clean` column of `gec/train.tsv` and the
`en` column of `ende/train.tsv` (3-80 words; with `--sentences-only`, full sentences only), deduplicated. Kept out of the pool: every `clean`
sentence of `gec/valid.tsv` and `gec/test.tsv`, the corrections of `models/data/learner-dev.tsv`,
and two hash-selected slices of the ende sentences that are not in gec/train.tsv, one (`sha1 % 100 == 1`, 1,000 sentences) made into the
generated half of `valid.tsv` (seed 2; the other half is `gec/valid.tsv`), the other
(`sha1 % 100 == 0`) the held-out evaluation set `models/data/learner-gen-dev.tsv` (`--dev-out`,
1,000 sentences, seed 3), which is only rewritten when asked.
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import re
from multiprocessing import Pool
from pathlib import Path

from aggdec.train.ar import read_tsv
from aggdec.train.learner_errors import generate, render, tokenize

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 20_000


def _bucket(sentence: str) -> int:
    return int.from_bytes(hashlib.sha1(sentence.encode("utf-8")).digest()[:4], "big") % 100


def _open_text(path: Path) -> list[str]:
    """Lines of a text file (`.xz` read compressed)."""
    raw = lzma.open(path, "rt", encoding="utf-8") if path.suffix == ".xz" else open(path, encoding="utf-8")
    with raw as f:
        return [line.rstrip("\n") for line in f]


def _norm(sentence: str) -> str:
    return render(tokenize(sentence), tokenized=True)


def held_out(data: Path) -> set[str]:
    """Sentences never trained on (tokenised, so that spacing does not hide a match): the clean side
    of gec/valid.tsv and gec/test.tsv and the corrections of models/data/learner-dev.tsv."""
    held = set(read_tsv(data / "gec" / "valid.tsv", "noisy", "clean")[1])
    held |= set(read_tsv(data / "gec" / "test.tsv", "noisy", "clean")[1])
    held |= set(read_tsv(ROOT / "models" / "data" / "learner-dev.tsv", "noisy", "clean")[1])
    return {_norm(s) for s in held}


SENTENCE_RE = re.compile(r"""^["'(]?[A-Z].*[.!?]["')]?$""")


def is_sentence(s: str) -> bool:
    """A full sentence: starts with a capital, ends with . ! or ? (maybe quoted), four words or more."""
    return bool(SENTENCE_RE.match(s)) and len(s.split()) >= 4


def clean_pool(data: Path, ende_en: Path | None, sentences_only: bool = False) -> tuple[list[str], list[str], list[str]]:
    """-> (training pool, valid slice, dev slice) of clean English sentences, in a fixed order.
    `sentences_only` keeps only full sentences (`is_sentence`) in the pool; the slices do not change."""
    _, gec_clean = read_tsv(data / "gec" / "train.tsv", "noisy", "clean")
    en = _open_text(ende_en) if ende_en else read_tsv(data / "ende" / "train.tsv", "en", "de")[0]
    held = held_out(data)
    seen: set[str] = set()
    pool, valid, dev = [], [], []
    in_gec = set(gec_clean)  # its pairs are trained on as they are: never held out
    for s in gec_clean + en:
        s = s.strip()
        if s in seen or not 3 <= len(s.split()) <= 80 or "\t" in s:
            continue
        seen.add(s)
        if _norm(s) in held:
            continue
        b = 99 if s in in_gec else _bucket(s)
        if b > 1 and sentences_only and not is_sentence(s):
            continue
        (dev if b == 0 else valid if b == 1 else pool).append(s)
    return pool, valid[:1000], dev[:1000]


def _gen(args: tuple[list[str], int, int, int]):
    chunk, seed, copies, offset = args
    return generate(chunk, seed=seed, copies=copies, offset=offset)


def write_tsv(path: Path, rows, source: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("source\tnoisy\tclean\n")
        for noisy, clean, *_ in rows:
            f.write(f"{source}\t{noisy}\t{clean}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="folder holding gec/ and ende/ (TSV splits)")
    p.add_argument("--ende-en", type=Path, help="the `en` column of ende/train.tsv as text (.xz ok), if "
                   "ende/train.tsv is not under --data")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--sentences-only", action="store_true", help="generate errors on full sentences only "
                   "(capitalised, final . ! or ?, four words or more), not on phrases and UI strings")
    p.add_argument("--dev-out", type=Path, help="also (re)write the held-out generated evaluation set here")
    a = p.parse_args(argv)
    pool, valid, dev = clean_pool(a.data, a.ende_en, a.sentences_only)
    a.out.mkdir(parents=True, exist_ok=True)
    chunks = [(pool[i:i + CHUNK], 1, a.copies, i) for i in range(0, len(pool), CHUNK)]
    with Pool(a.workers) as workers:
        generated = [row for part in workers.map(_gen, chunks) for row in part]
    gec_noisy, gec_clean = read_tsv(a.data / "gec" / "train.tsv", "noisy", "clean")
    held = held_out(a.data)
    gec_pairs = [(n, c) for n, c in zip(gec_noisy, gec_clean) if _norm(c) not in held]
    with open(a.out / "train.tsv", "w", encoding="utf-8") as f:
        f.write("source\tnoisy\tclean\n")
        for noisy, clean in gec_pairs:
            f.write(f"gec\t{noisy}\t{clean}\n")
        for noisy, clean, _ in generated:
            f.write(f"learner\t{noisy}\t{clean}\n")
    va_noisy, va_clean = read_tsv(a.data / "gec" / "valid.tsv", "noisy", "clean")
    write_tsv(a.out / "valid.tsv", list(zip(va_noisy, va_clean)) + generate(valid, seed=2), "valid")
    if a.dev_out:
        write_tsv(a.dev_out, generate(dev, seed=3), "generated")
    changed = sum(n != c for n, c, _ in generated)
    print(f"pool {len(pool)} clean sentences -> {len(generated)} generated pairs ({changed} with errors); "
          f"train {len(gec_pairs) + len(generated)} pairs; valid {len(va_noisy) + len(valid)}; dev {len(dev)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
