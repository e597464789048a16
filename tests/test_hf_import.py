"""Hugging Face encoder-decoders as verifiers: tiny models of each family (tests/hf_models.py) decode
token-identically to transformers' greedy `generate`, with every lossless method, from the directory
itself or after `aggdec convert --from transformers`; bad directories fail with one named error."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

transformers = pytest.importorskip("transformers")  # the `hf` extra; CI installs it

import hf_models  # noqa: E402
from conftest import synthetic_sentences  # noqa: E402

from aggdec import checkpoint, hf_import  # noqa: E402
from aggdec.api import Translator, decode_options  # noqa: E402
from aggdec.decoding.options import OptionError  # noqa: E402
from aggdec.model.draft_head import DraftHead, DraftHeadConfig  # noqa: E402

# one worker builds this module's session fixture once (`make test`: pytest-xdist's loadgroup)
pytestmark = pytest.mark.xdist_group("hf")

FAMILIES = ("marian", "bart", "mbart", "m2m100")  # every method on each
LAYOUTS = (*FAMILIES, "marian-separate", "nllb", "mbart50")  # greedy against transformers on each
BUILDERS = {"marian": hf_models.build_marian, "bart": hf_models.build_bart, "mbart": hf_models.build_mbart,
            "m2m100": hf_models.build_m2m100, "nllb": hf_models.build_nllb,
            "marian-separate": lambda out: hf_models.build_marian(out, separate=True),
            "mbart50": lambda out: hf_models.build_mbart(out, fifty=True)}
MANUAL_FRAMING = {"mbart": ([], ["</s>", "en_XX"]), "nllb": (["eng_Latn"], ["</s>"]),  # (prefix, suffix)
                  "mbart50": (["en_XX"], ["</s>"])}
TARGET = {"m2m100": "fr", "nllb": "fra_Latn", "mbart50": "de_DE"}
LIMIT = 40  # output tokens before eos is forced (max_len_a = 0, max_len_b = LIMIT)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """One trained tiny model directory per layout, built once per session (~5 s each)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {f: BUILDERS[f](tmp_path_factory.mktemp(f"hf-{f}")) for f in LAYOUTS}
    finally:
        torch.set_num_threads(threads)


def _langs(family: str) -> dict:
    return {"target_lang": TARGET[family]} if family in TARGET else {}


def _hf_tokenizer(family: str, d: Path):
    if family in MANUAL_FRAMING:  # a bare tokenizers pipeline, framed by hand below
        return transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    return transformers.AutoTokenizer.from_pretrained(d)


def _hf_source(family: str, d: Path, text: str) -> list[int]:
    """The source ids transformers' own tokenizer gives (mBART, NLLB: the saved tokenizer.json has no
    framing template, so MBartTokenizer's `text </s> en_XX` and NllbTokenizer's `eng_Latn text </s>`
    are written out)."""
    tok = _hf_tokenizer(family, d)
    if family in MANUAL_FRAMING:
        prefix, suffix = MANUAL_FRAMING[family]
        return (tok.convert_tokens_to_ids(prefix) + tok(text, add_special_tokens=False).input_ids
                + tok.convert_tokens_to_ids(suffix))
    return tok(text).input_ids


def _hf_greedy(model, src: list[int], family: str, d: Path) -> list[int]:
    kw = {}
    if family == "m2m100":
        kw["forced_bos_token_id"] = transformers.AutoTokenizer.from_pretrained(d).get_lang_id("fr")
    if family in ("nllb", "mbart50"):
        kw["forced_bos_token_id"] = _hf_tokenizer(family, d).convert_tokens_to_ids(TARGET[family])
    out = model.generate(torch.tensor([src]), num_beams=1, do_sample=False, max_new_tokens=LIMIT + 1, **kw)[0].tolist()
    out = [t for t in out[1:] if t != model.config.pad_token_id]
    return out[:-1] if out and out[-1] == model.config.eos_token_id else out


@pytest.mark.parametrize("family", LAYOUTS)
def test_greedy_is_token_identical_to_transformers(hf_dirs, family):
    d = hf_dirs[family]
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(d).eval()
    tr = Translator.load(d)
    texts = synthetic_sentences(60, seed=7)
    opts = decode_options("greedy", max_len_a=0, max_len_b=LIMIT, max_batch_size=16, **_langs(family))
    results = tr.translate_batch(texts, opts)
    framing = tr.framing(opts)
    assert len({tuple(r.tokens) for r in results}) >= 20  # a model with varied outputs, not a constant
    for text, r in zip(texts, results):
        src = _hf_source(family, d, text)
        assert tr.prepare(text, framing)[0] == src
        hf = _hf_greedy(model, src, family, d)
        if r.status == "truncated_output":  # cut at LIMIT tokens then eos; transformers goes one further
            assert hf[:LIMIT] == r.tokens
        else:
            assert r.status == "ok" and hf == r.tokens
    if family != "m2m100":  # detokenized as tokenizer.decode(..., skip_special_tokens=True); M2M100Tokenizer
        tok = _hf_tokenizer(family, d)  # keeps its language tokens (__fr__ ...) in the text, aggdec does not
        assert [r.text for r in results] == [tok.decode(r.tokens, skip_special_tokens=True) for r in results]


@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_methods_equal_greedy_on_imported_models(hf_dirs, family, tmp_path):
    tr = Translator.load(hf_dirs[family])
    cfg = tr.model.cfg
    torch.manual_seed(0)  # an untrained draft head: drafts are poor, outputs must not change
    head = DraftHead(DraftHeadConfig(d_model=cfg.d_model, heads=cfg.dec_heads, ffn=48, layers=1, block_size=4))
    checkpoint.save_draft_head(tmp_path / "head", head, {"verifier_sha": tr.bundle.sha})
    texts = synthetic_sentences(40, seed=3)
    common = dict(max_len_a=0, max_len_b=LIMIT, **_langs(family))
    want = [r.tokens for r in tr.translate_batch(texts, method="greedy", max_batch_size=1, **common)]
    for method, extra in (("iad", {}), ("iad", {"draft_length": "max"}), ("gad", {"drafter": str(tmp_path / "head"), "draft_length": "max"}),
                          ("gad", {"drafter": str(tmp_path / "head")})):
        for bs in (1, 7):
            got = tr.translate_batch(texts, method=method, max_batch_size=bs, **common, **extra)
            assert [r.tokens for r in got] == want, (method, extra, bs)
    iad = tr.translate_batch(texts, method="iad", max_batch_size=7, draft_length="max", **common)
    assert sum(r.stats.accepted for r in iad) > 0  # the copy drafts are used


@pytest.mark.parametrize("family", ("marian", "bart"))
def test_beam_runs_with_the_model_conventions(hf_dirs, family):
    """Beam is fairseq's (length normalization over the tokens incl. eos; transformers normalizes
    differently and stops the search earlier), so outputs are compared for the share only; forced
    tokens and the decoder start are the family's."""
    d = hf_dirs[family]
    tr = Translator.load(d)
    texts = synthetic_sentences(20, seed=5)
    res = tr.translate_batch(texts, method="beam", beam=4, max_len_a=0, max_len_b=LIMIT)
    assert all(r.status in ("ok", "truncated_output") for r in res)
    if family == "bart":
        assert all(r.tokens[0] == 0 for r in res)  # forced bos


def test_convert_writes_a_project_model_with_the_same_outputs(hf_dirs, tmp_path):
    d = hf_dirs["m2m100"]
    out = tmp_path / "converted"
    run = CliRunner().invoke(__import__("cli").main, ["convert", str(d), str(out), "--from", "transformers"])
    assert run.exit_code == 0, run.output
    config = json.loads((out / "config.json").read_text())
    assert config["conventions"]["forced"] == ["target_lang"] and config["meta"]["model_type"] == "m2m_100"
    texts = synthetic_sentences(30, seed=9)
    a = Translator.load(d).translate_batch(texts, method="iad", target_lang="de")
    b = Translator.load(out).translate_batch(texts, method="iad", target_lang="de")
    assert [r.tokens for r in a] == [r.tokens for r in b] and [r.text for r in a] == [r.text for r in b]
    c = Translator.load(out).translate_batch(texts, method="iad", target_lang="fr")
    assert [r.tokens[0] for r in c] != [r.tokens[0] for r in b]  # the target language token is forced


def test_decode_cli_reads_a_hugging_face_directory(hf_dirs):
    run = CliRunner().invoke(__import__("cli").main, ["decode", "-m", str(hf_dirs["marian"]), "--method", "iad"],
                             input="She go to school .\nThe cat .\n")
    assert run.exit_code == 0, run.output
    assert len(run.stdout.strip().splitlines()) == 2


def test_languages_are_checked(hf_dirs):
    tr = Translator.load(hf_dirs["m2m100"])
    with pytest.raises(OptionError, match="target_lang: 'xx' is not a language of this model"):
        tr.translate_batch(["The cat ."], target_lang="xx")
    assert tr.framing(decode_options(source_lang="fr")).prefix == (tr.bundle.conventions.languages["fr"],)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_directories_get_one_named_error(hf_dirs, tmp_path):
    d = _copy(hf_dirs["marian"], tmp_path / "pegasus")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "pegasus"}))
    with pytest.raises(ValueError, match=r"model_type 'pegasus' is not supported; supported: marian, bart, mbart, "
                                         r"m2m_100, t5, mt5, umt5"):
        checkpoint.load(d)

    d = _copy(hf_dirs["bart"], tmp_path / "mismatch")
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "encoder_ffn_dim": 48}))
    with pytest.raises(ValueError, match=r"tensor model\.encoder\.layers\.0\.fc1\.(weight|bias) has shape \(64"):
        checkpoint.load(d)

    d = _copy(hf_dirs["bart"], tmp_path / "pickle")
    from safetensors.torch import load_file

    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    with pytest.raises(PermissionError, match="pytorch_model.bin: a pickle"):
        checkpoint.load(d)
    trusted = Translator(hf_import.load(d, trust=True)).translate_batch(["The cat ."])
    assert trusted[0].tokens == Translator.load(hf_dirs["bart"]).translate_batch(["The cat ."])[0].tokens
    run = CliRunner().invoke(__import__("cli").main, ["decode", "-m", str(d), "--trust-checkpoint"], input="The cat .\n")
    assert run.exit_code == 0 and run.stdout.strip() == trusted[0].text

    d = _copy(hf_dirs["marian"], tmp_path / "no-spm")
    (d / "target.spm").unlink()
    with pytest.raises(FileNotFoundError, match="needs target.spm"):
        checkpoint.load(d)
    run = CliRunner().invoke(__import__("cli").main, ["decode", "-m", str(d)], input="x\n")
    assert run.exit_code != 0 and "needs target.spm" in run.output


def test_a_corpus_job_decodes_with_an_imported_model(hf_dirs, tmp_path):
    """A job on the Hugging Face directory itself, its target language from the spec's [decode]."""
    from test_jobs import write_corpus, write_spec

    from jobs.preflight import check_job
    from jobs.spec import SpecError, load_spec

    d = hf_dirs["m2m100"]
    inp = write_corpus(tmp_path / "in", shards=2, rows=10)
    bad = load_spec(write_spec(tmp_path / "bad.toml", d, inp, tmp_path / "bad-out",
                               decode={"method": '"iad"', "target_lang": '"xx"'}))
    with pytest.raises(SpecError, match="decode.target_lang: 'xx' is not a language of this model"):
        check_job(bad)  # as `aggdec run`, before Ray starts
    spec = load_spec(write_spec(tmp_path / "job.toml", d, inp, tmp_path / "out",
                                decode={"method": '"iad"', "target_lang": '"fr"'}, resources={"actors": "1"}))
    job_decodes_as_the_api(spec, d, tmp_path / "out", rows=20)


def job_decodes_as_the_api(spec, model_dir: Path, out: Path, rows: int) -> None:
    """Run the job `spec` on a new local Ray (after `aggdec run`'s checks): its `rows` rows hold the
    API's texts and statuses for their sources."""
    from test_jobs import run_on_new_ray

    from jobs.preflight import check_job

    check_job(spec)
    result, table = run_on_new_ray(spec, out)
    assert result.rows == table.num_rows == rows
    want = Translator.load(model_dir).translate_batch(table.column("src").to_pylist(), spec.decode)
    assert table.column("hyp").to_pylist() == [r.text for r in want]
    assert table.column("status").to_pylist() == [r.status for r in want]


def test_an_imported_model_is_not_exported_to_fairseq(hf_dirs, tmp_path):
    from aggdec.fairseq_io import save_fairseq

    with pytest.raises(ValueError, match="first_position=0 has no fairseq"):
        save_fairseq(checkpoint.load(hf_dirs["marian"]), tmp_path / "fs")
