"""Public API: every input yields one result with a status; bad input never crashes."""

import pytest
from conftest import synthetic_sentences

from aggdec.api import Translator, decode_options, summarize
from aggdec.text import clean_text


def test_clean_text():
    assert clean_text("a\ud800b\x07c\n  d") == "a\ufffdb c d"
    assert clean_text(None) == "" and clean_text("  \t ") == ""
    assert clean_text(12) == "12"


def test_bad_rows_get_statuses(tiny_model_dir):
    tr = Translator.load(tiny_model_dir)
    long = " ".join(["the cat"] * 200)
    src = ["", "   ", "She go to school .", long, "bad\x00ctrl\x1bchars", "lone \ud800 surrogate", "日本語 ☃ ünïcödé"]
    res = tr.translate_batch(src, method="iad", max_batch_size=3)
    assert len(res) == len(src)
    assert [r.status for r in res] == ["empty", "empty", "ok", "truncated", "ok", "truncated_output", "unknown_tokens"]
    assert res[5].error.startswith("the output reached the length limit") and len(res[5].tokens) == 31
    assert res[0].text == "" and res[3].src_len == tr.cfg.max_source_positions
    assert tr.cfg.unk in tr.bundle.src_tok.encode("☃")  # characters outside the vocabulary -> unknown token
    summary = summarize(res)
    assert summary["rows"] == 7 and summary["status"] == {"empty": 2, "ok": 2, "truncated": 1, "truncated_output": 1,
                                                          "unknown_tokens": 1}
    [cjk] = tr.translate_batch(["日本語の文 ☃☃ 中文"], method="greedy")
    assert cjk.status == "unknown_tokens" and cjk.text  # flagged, still decoded
    [lenient] = tr.translate_batch(["日本語の文 ☃☃ 中文"], method="greedy", max_unknown_share=1.0)
    assert lenient.status == "lost_characters" and lenient.text  # decoded, with what the model never saw named
    assert lenient.error.startswith("the tokenizer drops 7 character(s) of the source: U+65E5 ")
    assert "and 2 more" in lenient.error


def test_statuses_name_what_tokenizers_lose_and_outputs_that_are_not_utf8():
    """Right-to-left marks and other format characters in a source either survive the tokenizer or are
    named (status lost_characters); an output whose byte tokens do not form UTF-8 (U+FFFD in its text)
    is status invalid_output; both are counted. `models/gec-base` has byte pieces: its tokenizer keeps
    U+202E and U+202C (as bytes) and drops U+200F."""
    tr = Translator.load("models/gec-base")
    src = ["She \u200fgo to \u202eschool\u202c yesterday .", "She go to \u202eschool\u202c .",
           "Ｆｕｌｌ width ﬁne café .", "She go to school ."]
    res = tr.translate_batch(src, method="iad")
    assert "U+200F RIGHT-TO-LEFT MARK" in res[0].error and "U+202E" not in res[0].error
    for r in res:
        broken = r.text.count("\ufffd") > r.source.count("\ufffd")
        assert (r.status == "invalid_output") == broken, (r.text, r.status)
        assert (r.status == "lost_characters") == (not broken and "U+" in r.error), (r.text, r.status, r.error)
        assert r.status in ("ok", "invalid_output", "lost_characters"), r.status
    assert res[0].status in ("invalid_output", "lost_characters")
    assert "\u202e" in res[1].source and "drops" not in res[1].error  # bytes carry it: nothing lost
    assert res[2].error == ""  # NFKC: the tokenizer's normalization loses nothing
    assert summarize(res)["status"].get(res[0].status) >= 1


def test_lossless_methods_agree_and_options_validate(tiny_model_dir):
    tr = Translator.load(tiny_model_dir)
    src = synthetic_sentences(30, seed=3)
    greedy = [r.text for r in tr.translate_batch(src, method="greedy", max_batch_size=4)]
    for opts in (decode_options("iad", max_batch_size=7), decode_options("iad", draft_cap=3, substitution=True),
                 decode_options("iad", substitution=True, nearest_match=True),
                 decode_options("iad", draft_cap=8, adaptive_draft=True, max_tokens=50)):
        assert [r.text for r in tr.translate_batch(src, opts)] == greedy
    beam1 = [r.text for r in tr.translate_batch(src, method="beam", beam=1)]
    assert beam1 == greedy
    with pytest.raises(ValueError, match="method: must be one of"):
        decode_options("nope")
    with pytest.raises(ValueError, match="max_batch_size"):
        decode_options(max_batch_size=0)


def test_translate_iterable_keeps_order(tiny_model_dir):
    tr = Translator.load(tiny_model_dir)
    src = synthetic_sentences(11, seed=4)
    streamed = [r.text for r in tr.translate_iterable(iter(src), chunk_size=4, method="iad")]
    assert streamed == [r.text for r in tr.translate_batch(src)]


def test_model_dir_errors_name_the_file(tmp_path, tiny_model_dir):
    import shutil

    with pytest.raises(FileNotFoundError, match="no config.json"):
        Translator.load(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        Translator.load(bad)


def test_cli_decode_runs_in_process_and_names_a_bad_device(tiny_model_dir, monkeypatch):
    import torch
    from click.testing import CliRunner

    from cli import main

    src = "\n".join(synthetic_sentences(5, seed=3)) + "\n"
    ref = [r.text for r in Translator.load(tiny_model_dir).translate_batch(src.splitlines(), method="greedy")]
    res = CliRunner().invoke(main, ["decode", "-m", str(tiny_model_dir), "--method", "iad", "--device", "cpu"], input=src)
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[:5] == ref
    assert res.output.splitlines()[-1].startswith("5 sentences in ")
    assert "tokens per verifier call" in res.output.splitlines()[-1]
    res = CliRunner().invoke(main, ["decode", "-m", str(tiny_model_dir), "--method", "beam"], input=src)
    summary = res.output.splitlines()[-1]
    assert res.exit_code == 0 and "decoder calls a sentence (beams together)" in summary and "verifier" not in summary
    assert "accepted" not in summary  # no drafts, no acceptance figure
    res = CliRunner().invoke(main, ["decode", "-m", str(tiny_model_dir)], input=src.splitlines()[0] + "\n")
    assert res.exit_code == 0 and res.output.splitlines()[-1].startswith("1 sentence in "), res.output
    for flag in ("--batch-size", "--max-batch-size"):  # the CLI's name and the job spec's
        res = CliRunner().invoke(main, ["decode", "-m", str(tiny_model_dir), flag, "2"], input=src)
        assert res.exit_code == 0 and res.output.splitlines()[:5] == ref, (flag, res.output)
    from aggdec.model.config import HF_FAMILIES

    for command in ("decode", "convert"):
        shown = " ".join(CliRunner().invoke(main, [command, "--help"]).output.split())
        assert all(family in shown for family in HF_FAMILIES), (command, shown)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(main, ["decode", "-m", str(tiny_model_dir), "--device", "cuda"], input=src)
    assert res.exit_code == 2 and "--device" in res.output and "no CUDA device" in res.output


def test_an_exported_fairseq_checkpoint_segments_raw_text_with_its_model(tiny_model_dir, tmp_path):
    """`aggdec convert --to fairseq` of a sentencepiece model: decoding the checkpoint without --bpe
    segments raw text with the copied sentencepiece model (the project model's outputs), and refuses
    in one line naming the file when that model is gone."""
    from aggdec.fairseq_io import load_fairseq, save_fairseq

    sents = synthetic_sentences(6, seed=5)
    ref = [r.text for r in Translator.load(tiny_model_dir).translate_batch(sents)]
    exp = save_fairseq(tiny_model_dir, tmp_path / "fs")
    got = Translator(load_fairseq(exp / "checkpoint.pt", exp, trust=True)).translate_batch(sents)
    assert [r.text for r in got] == ref and {r.status for r in got} == {"ok"}
    (exp / "spm.model").unlink()
    with pytest.raises(FileNotFoundError, match=r"spm.model: .* pass --bpe sentencepiece --bpe-model PATH$"):
        load_fairseq(exp / "checkpoint.pt", exp, trust=True)


def test_the_readme_python_api_example_runs_as_written():
    """The README's Python API block, run as written from the checkout's root in a process of its own,
    prints its two lines."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    block = readme.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run([sys.executable, "-c", block], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stdout.splitlines()) == 2 and "ok" in done.stdout.splitlines()[0], done.stdout


def test_a_batch_that_fails_is_decoded_row_by_row_and_says_so(tiny_model_dir, monkeypatch):
    """A batch whose decoding raises (here a fault put into batches of several rows) is retried row by row:
    every row decoded, and one warning names the batch's failure (the rows alone run many times slower)."""
    import warnings

    tr = Translator.load(tiny_model_dir)
    run = Translator._run

    def failing(self, reqs, opts):
        if len(reqs) > 1:
            raise RuntimeError("a fault in batches")
        return run(self, reqs, opts)

    monkeypatch.setattr(Translator, "_run", failing)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = tr.translate_batch(["She go to school .", "He have a cat ."], method="greedy", compile=False)
    assert [r.status for r in res] == ["ok", "ok"] and all(r.text for r in res)
    said = [str(w.message) for w in seen if "batch" in str(w.message)]
    assert said == ["aggdec: a batch of 2 sentences failed (RuntimeError: a fault in batches); decoding its rows one "
                    "at a time"]
