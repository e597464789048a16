"""The compact AR trainer: a tiny run on synthetic pairs saves a loadable model whose loss went down."""

from __future__ import annotations

import json
import math
import random
import re

from aggdec import checkpoint
from aggdec.decoding.metadata import Request
from aggdec.decoding.slot_loop import SlotLoop
from aggdec.train.ar import TrainConfig, main, read_tsv, train_ar
from aggdec.train.spm import train_sentencepiece

WORDS = ("the cat dog sat on a mat and ran to big small red house with my friend she he they went school "
         "book read wrote teacher student happy sad today morning evening green quick slow people city").split()


def _pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Noisy -> clean toy GEC pairs: the noisy side drops or duplicates one word."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        clean = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        noisy = list(clean)
        i = rng.randrange(len(noisy))
        if rng.random() < 0.5:
            del noisy[i]
        else:
            noisy.insert(i, noisy[i])
        out.append((" ".join(noisy), " ".join(clean) + " ."))
    return out


def _write_tsv(path, pairs) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("source\tnoisy\tclean\n")
        for s, t in pairs:
            f.write(f"toy\t{s}\t{t}\n")


def test_tiny_run_saves_loadable_model_and_loss_drops(tmp_path, capsys):
    pairs = _pairs(60)
    _write_tsv(tmp_path / "train.tsv", pairs[:50])
    _write_tsv(tmp_path / "valid.tsv", pairs[50:])
    src, tgt = read_tsv(tmp_path / "train.tsv", "noisy", "clean")
    assert len(src) == 50 and src[0] == pairs[0][0] and tgt[0] == pairs[0][1]
    spm_path = train_sentencepiece(src + tgt, tmp_path / "spm" / "toy", 64, byte_fallback=False)

    cfg = TrainConfig(train=str(tmp_path / "train.tsv"), valid=str(tmp_path / "valid.tsv"), src_col="noisy",
                      tgt_col="clean", out=str(tmp_path / "model"), spm_model=str(spm_path), d_model=16, heads=2,
                      ffn=32, enc_layers=1, dec_layers=1, max_positions=64, dropout=0.0, max_tokens=256, lr=1e-2,
                      warmup=5, max_updates=200, log_interval=20, eval_updates=50, max_minutes=1.0, threads=1)
    out = train_ar(cfg)
    logged = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"train \| update \d+ .*?\| loss ([0-9.]+)", logged)]
    assert len(losses) == 10
    assert losses[-1] < 0.8 * losses[0]

    bundle = checkpoint.load(out)
    meta = json.loads((out / "config.json").read_text())["meta"]
    assert meta["valid_nll"] < 0.8 * math.log(64)
    assert 0 < meta["updates"] <= 200
    assert bundle.model.cfg.share_all_embeddings and bundle.model.cfg.d_model == 16
    reqs = [Request(i, bundle.src_tok.encode(s) + [bundle.model.cfg.eos], 30) for i, (s, _) in enumerate(pairs[50:])]
    hyps = sorted(SlotLoop(bundle.model, max_batch_size=4).run(reqs), key=lambda h: h.index)
    assert [h.index for h in hyps] == list(range(10))
    assert all(len(h.tokens) <= 30 for h in hyps)
    assert all(isinstance(bundle.tgt_tok.decode(h.tokens), str) for h in hyps)

    # --init-from continues the update count and keeps the tokenizer
    main(["--train", cfg.train, "--valid", cfg.valid, "--src-col", "noisy", "--tgt-col", "clean",
          "--out", str(tmp_path / "more"), "--init-from", str(out), "--max-updates", "5", "--max-tokens", "256"])
    more = json.loads((tmp_path / "more" / "config.json").read_text())["meta"]
    assert more["updates"] == meta["updates"] + 5 and more["init_from"]["updates"] == meta["updates"]
    checkpoint.load(tmp_path / "more")


def test_presets_without_their_data_fail_in_one_line(tmp_path):
    """`--task` without the project's corpora names the missing file and how to give data; a missing
    --train file is named too."""
    import pytest

    with pytest.raises(SystemExit) as err:
        main(["--task", "gec", "--data-dir", str(tmp_path), "--out", str(tmp_path / "m")])
    msg = str(err.value.code)
    assert msg.startswith(f"--task gec: {tmp_path / 'gec' / 'train.tsv'} not found;") and "\n" not in msg
    assert "--data-dir DIR" in msg and "--train FILE --valid FILE --src-col COL --tgt-col COL" in msg
    with pytest.raises(SystemExit, match=r"^--train: .*en\.tsv not found; give --train FILE"):
        main(["--train", str(tmp_path / "en.tsv"), "--valid", str(tmp_path / "en.tsv"), "--src-col", "en",
              "--tgt-col", "de", "--out", str(tmp_path / "m")])
