"""Seq-KD -> drafter and proposal-heads training -> GAD / GAD++ / blockwise through the public API."""

import dataclasses
import json

import pytest
import torch

from conftest import synthetic_sentences

from aggdec.api import Translator, decode_options
from aggdec.train import drafter as drafter_train
from aggdec.train.seqkd import generate


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gad")
    kd = tmp / "kd.tsv"
    torch.set_num_threads(1)
    assert generate(tiny_model_dir, synthetic_sentences(120, seed=5), kd, batch_size=32) > 100
    common = ["--verifier", str(tiny_model_dir), "--data", str(kd), "--max-minutes", "0.05", "--threads", "1",
              "--max-tokens", "512", "--warmup", "20", "--log-interval", "1000"]
    drafter_train.main(["drafter", *common, "--out", str(tmp / "drafter"), "--block-size", "4"])
    drafter_train.main(["heads", *common, "--out", str(tmp / "heads"), "--block-size", "3", "--hidden", "32"])
    return tmp


def test_drafter_training_continues_from_a_drafter(tiny_model_dir, trained, tmp_path):
    common = ["--verifier", str(tiny_model_dir), "--data", str(trained / "kd.tsv"), "--max-minutes", "0.02",
              "--threads", "1", "--max-tokens", "512", "--log-interval", "1000"]
    drafter_train.main(["drafter", *common, "--init-from", str(trained / "drafter"), "--out", str(tmp_path / "more")])
    first = Translator.load(tiny_model_dir)._drafter_model(str(trained / "drafter")).meta
    more = Translator.load(tiny_model_dir)._drafter_model(str(tmp_path / "more")).meta
    assert more["updates"] > first["updates"] and more["init_from"]["updates"] == first["updates"]
    with pytest.raises(SystemExit, match="not a NAR drafter"):
        drafter_train.main(["drafter", *common, "--init-from", str(tiny_model_dir), "--out", str(tmp_path / "bad")])


def test_gad_family_is_lossless_through_the_api(tiny_model_dir, trained):
    tr = Translator.load(tiny_model_dir)
    src = synthetic_sentences(40, seed=9) + ["", "   "]
    greedy = [r.text for r in tr.translate_batch(src, method="greedy", max_batch_size=8)]
    for opts in (decode_options("gad", drafter=str(trained / "drafter"), block_size=4, max_batch_size=8),
                 decode_options("gad", drafter=str(trained / "drafter"), block_size=4, adaptive_draft=True),
                 decode_options("gad++", drafter=str(trained / "drafter"), top_beta=1, tau=3.0),
                 decode_options("blockwise", drafter=str(trained / "heads"), max_batch_size=5)):
        for precision in ("fp32", "bf16-certified"):  # the second also runs the drafters in bf16
            res = tr.translate_batch(src, dataclasses.replace(opts, verify_precision=precision))
            assert [r.text for r in res] == greedy, (opts, precision)
            assert [r.status for r in res][-2:] == ["empty", "empty"]
            assert all(r.stats.iterations >= 1 for r in res[:-2])


def test_no_output_depends_on_verify_precision(tiny_model_dir, trained):
    """Lossy methods keep fp32 drafters and fp32 logits under bf16-certified, so they match too."""
    tr = Translator.load(tiny_model_dir)
    src = synthetic_sentences(40, seed=11)
    for opts in (decode_options("gad++", drafter=str(trained / "drafter"), top_beta=3, tau=2.0),
                 decode_options("blockwise", drafter=str(trained / "heads"), top_k_accept=3),
                 decode_options("gad", drafter=str(trained / "drafter"), block_size=4, min_block=2)):
        assert not opts.lossless
        runs = [[r.text for r in tr.translate_batch(src, dataclasses.replace(opts, verify_precision=p))]
                for p in ("fp32", "bf16-certified")]
        assert runs[0] == runs[1], opts


def test_drafter_errors_name_the_directory(tiny_model_dir, trained):
    tr = Translator.load(tiny_model_dir)
    with pytest.raises(ValueError, match="needs a drafter"):
        decode_options("gad")
    with pytest.raises(ValueError, match="not a NAR drafter"):
        tr.translate_batch(["a b c"], method="gad", drafter=str(tiny_model_dir))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        tr.translate_batch(["a b c"], method="blockwise", drafter=str(trained / "missing"))


def test_block_layout_masks_the_k_tokens_after_the_cut():
    mask, pad, eos = 99, 1, 2
    s, seq, limit, target = drafter_train.block_layout_batch(
        src=[[10, 11], [12]], tgt=[[20, 21, 22, 23], [30, 31]], cuts=[1, 1], k=3, mask_id=mask)
    assert s.tolist() == [[10, 11, eos], [12, eos, pad]]
    # [eos, y_1 .. y_c, k masks]; the block after a cut of 1 covers y_2 .. y_4 (row 0) and y_2, eos (row 1).
    assert seq.tolist() == [[eos, 20, mask, mask, mask], [eos, 30, mask, mask, mask]]
    assert target.tolist() == [[pad, pad, 21, 22, 23], [pad, pad, 31, eos, pad]]
    # Prefix positions attend causally; the masks see each other (up to the last mask).
    assert limit.tolist() == [[0, 1, 4, 4, 4], [0, 1, 4, 4, 4]]


def test_draft_head_trains_on_stored_features_and_decodes_losslessly(tiny_model_dir, tmp_path):
    """features (greedy targets + verifier states) -> train -> a draft head GAD loads; output = greedy."""
    from aggdec.train import draft_head as head_train

    sources = synthetic_sentences(40, seed=9)
    data = tmp_path / "src.tsv"
    data.write_text("src\n" + "\n".join(sources) + "\n", encoding="utf-8")
    torch.set_num_threads(1)
    head_train.main(["features", "--verifier", str(tiny_model_dir), "--data", str(data), "--column", "src",
                     "--out", str(tmp_path / "feats"), "--threads", "1"])
    head_train.main(["train", "--verifier", str(tiny_model_dir), "--features", str(tmp_path / "feats"),
                     "--out", str(tmp_path / "head"), "--block-size", "3", "--ffn", "32", "--draft-vocab", "20",
                     "--positions", "128", "--warmup", "2", "--max-updates", "6", "--valid", "8", "--threads", "1",
                     "--log-interval", "1000"])
    tr = Translator.load(tiny_model_dir)
    meta = json.loads((tmp_path / "head" / "config.json").read_text())["meta"]
    assert meta["updates"] == 6 and len(meta["held_out"]["accuracy_by_position"]) == 3
    greedy = tr.translate_batch(sources, decode_options("greedy", max_batch_size=8))
    for length in ("auto", "max"):
        gad = tr.translate_batch(sources, decode_options("gad", drafter=str(tmp_path / "head"), block_size=3,
                                                         max_batch_size=8, draft_length=length))
        assert [r.tokens for r in gad] == [r.tokens for r in greedy]
