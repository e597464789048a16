"""Seq-KD -> draft-head and proposal-heads training -> GAD / GAD++ / blockwise through the public API."""

import dataclasses
import json

import pytest
import torch
from conftest import synthetic_sentences

from aggdec.api import Translator, decode_options
from aggdec.decoding.budget import DraftBudget
from aggdec.decoding.methods import get_method
from aggdec.train import draft_head as head_train
from aggdec.train import heads as heads_train
from aggdec.train.seqkd import generate


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A draft head (features -> train) and proposal heads (Seq-KD TSV) for the tiny model."""
    tmp = tmp_path_factory.mktemp("gad")
    kd = tmp / "kd.tsv"
    torch.set_num_threads(1)
    sources = synthetic_sentences(120, seed=5)
    assert generate(tiny_model_dir, sources, kd, batch_size=32)["kept"] > 100
    heads_train.main(["--verifier", str(tiny_model_dir), "--data", str(kd), "--max-minutes", "0.05", "--threads", "1",
                      "--max-tokens", "512", "--warmup", "20", "--log-interval", "1000", "--out", str(tmp / "heads"),
                      "--block-size", "3", "--hidden", "32"])
    data = tmp / "src.tsv"
    data.write_text("src\n" + "\n".join(sources) + "\n", encoding="utf-8")
    head_train.main(["features", "--verifier", str(tiny_model_dir), "--data", str(data), "--column", "src",
                     "--out", str(tmp / "feats"), "--threads", "1"])
    head_train.main(["train", "--verifier", str(tiny_model_dir), "--features", str(tmp / "feats"),
                     "--out", str(tmp / "head"), "--block-size", "4", "--ffn", "32", "--draft-vocab", "40",
                     "--positions", "128", "--warmup", "2", "--max-updates", "30", "--valid", "8", "--threads", "1",
                     "--log-interval", "1000"])
    return tmp


def test_gad_family_is_lossless_through_the_api(tiny_model_dir, trained):
    tr = Translator.load(tiny_model_dir)
    src = synthetic_sentences(40, seed=9) + ["", "   "]
    greedy = [r.text for r in tr.translate_batch(src, method="greedy", max_batch_size=8)]
    for opts in (decode_options("gad", drafter=str(trained / "head"), block_size=4, max_batch_size=8),
                 decode_options("gad", drafter=str(trained / "head"), block_size=2, draft_length="max"),
                 decode_options("gad++", drafter=str(trained / "head"), top_beta=1, tau=3.0),
                 decode_options("blockwise", drafter=str(trained / "heads"), max_batch_size=5)):
        for precision in ("fp32", "bf16-certified"):  # the second also runs the drafters in bf16
            res = tr.translate_batch(src, dataclasses.replace(opts, verify_precision=precision))
            assert [r.text for r in res] == greedy, (opts, precision)
            assert [r.status for r in res][-2:] == ["empty", "empty"]
            assert all(r.stats.iterations >= 1 for r in res[:-2])


def test_no_output_depends_on_verify_precision(tiny_model_dir, trained):
    """Lossy methods keep fp32 drafters and fp32 logits under bf16-certified, so they match too (at
    draft_length max: under auto their output depends on timing)."""
    tr = Translator.load(tiny_model_dir)
    src = synthetic_sentences(40, seed=11)
    for opts in (decode_options("gad++", drafter=str(trained / "head"), top_beta=3, tau=2.0, draft_length="max"),
                 decode_options("blockwise", drafter=str(trained / "heads"), top_k_accept=3, draft_length="max"),
                 decode_options("gad", drafter=str(trained / "head"), block_size=4, min_block=2, draft_length="max")):
        assert not get_method(opts.method).lossless(opts)
        runs = [[r.text for r in tr.translate_batch(src, dataclasses.replace(opts, verify_precision=p))]
                for p in ("fp32", "bf16-certified")]
        assert runs[0] == runs[1], opts


def test_lossy_methods_follow_the_draft_budget(tiny_model_dir, trained, monkeypatch):
    """gad++ under draft_length auto drafts what the budget picks: where no draft pays (the budget
    picks 0 every call) it takes plain greedy steps and gives greedy's output; max drafts in full."""
    tr = Translator.load(tiny_model_dir)
    src = synthetic_sentences(40, seed=12)
    greedy = [r.tokens for r in tr.translate_batch(src, method="greedy", max_batch_size=8)]
    opts = decode_options("gad++", drafter=str(trained / "head"), top_beta=3, tau=2.0, max_batch_size=8)
    full = tr.translate_batch(src, dataclasses.replace(opts, draft_length="max"))
    assert [r.tokens for r in full] != greedy, "the tolerant acceptance changes some outputs"
    monkeypatch.setattr(DraftBudget, "next_length", lambda self, rows, limit: 0)
    off = tr.translate_batch(src, opts)
    assert [r.tokens for r in off] == greedy
    assert sum(r.stats.drafted for r in off) == 0


def test_drafter_errors_name_the_directory(tiny_model_dir, trained):
    tr = Translator.load(tiny_model_dir)
    with pytest.raises(ValueError, match="needs a drafter"):
        decode_options("gad")
    with pytest.raises(ValueError, match="not a drafter directory"):
        tr.translate_batch(["a b c"], method="gad", drafter=str(tiny_model_dir))
    with pytest.raises(ValueError, match="not a draft head"):
        tr.translate_batch(["a b c"], method="gad", drafter=str(trained / "heads"))
    with pytest.raises(FileNotFoundError, match="no such drafter directory"):
        tr.translate_batch(["a b c"], method="blockwise", drafter=str(trained / "missing"))


def test_draft_head_trains_on_stored_features_and_decodes_losslessly(tiny_model_dir, trained):
    """features (greedy targets + verifier states) -> train -> a draft head GAD loads; output = greedy."""
    meta = json.loads((trained / "head" / "config.json").read_text())["meta"]
    assert meta["updates"] == 30 and len(meta["held_out"]["accuracy_by_position"]) == 4
    tr = Translator.load(tiny_model_dir)
    sources = synthetic_sentences(40, seed=9)
    greedy = tr.translate_batch(sources, decode_options("greedy", max_batch_size=8))
    for length in ("auto", "max"):
        gad = tr.translate_batch(sources, decode_options("gad", drafter=str(trained / "head"), block_size=3,
                                                         max_batch_size=8, draft_length=length))
        assert [r.tokens for r in gad] == [r.tokens for r in greedy]
        if length == "max":
            assert sum(r.stats.accepted for r in gad) > 0, "the trained head's drafts are accepted"
