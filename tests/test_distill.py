"""Distill jobs (Seq-KD data at scale): n-best and scores in the API, filters, the training TSV, and
proposal heads trained on that TSV. Real local Ray (2 CPUs), real Parquet, the tiny model fixture."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from conftest import synthetic_sentences
from test_jobs import ray_local, read_outputs, write_spec  # noqa: F401  (ray_local: a module fixture)

from aggdec import checkpoint
from aggdec.api import Translator, decode_options
from aggdec.distill import TSV_HEADER, distill_table, filter_reasons, merge_counts
from aggdec.text import clean_text
from aggdec.train import heads as heads_train
from aggdec.train.ar import read_tsv
from jobs.run import run_job
from jobs.spec import DistillSpec, SpecError, load_spec

ROWS = 12  # per shard, 2 shards


def write_distill_corpus(root: Path) -> Path:
    """2 shards with columns src, n; shard 1 also holds an empty, a null and a control-character row."""
    root.mkdir(parents=True, exist_ok=True)
    texts = synthetic_sentences(2 * ROWS, seed=11)
    texts[ROWS + 1], texts[ROWS + 2], texts[ROWS + 3] = "", None, "the cat\tgoes\nto school ."
    for k in range(2):
        chunk = texts[k * ROWS:(k + 1) * ROWS]
        pq.write_table(pa.table({"src": pa.array(chunk, pa.string()), "n": list(range(k * ROWS, (k + 1) * ROWS))}),
                       root / f"part-{k:05d}.parquet")
    return root


def distill_spec(tmp_path: Path, model: Path, inp: Path, out: Path, *overrides: str):
    return load_spec(write_spec(tmp_path / f"{out.name}.toml", model, inp, out, resources={"actors": "1"}),
                     ["kind=distill", *overrides])


def test_api_nbest_and_scores(tiny_model_dir):
    tr = Translator.load(tiny_model_dir)
    src = synthetic_sentences(16, seed=11) + [""]
    best = tr.translate_batch(src, method="beam", beam=5)
    five = tr.translate_batch(src, method="beam", beam=5, nbest=5)
    assert [r.text for r in five] == [r.text for r in best] and all(r.nbest == [] for r in best)
    for r in five[:-1]:
        assert r.nbest[0] == (r.text, r.score)
        assert [s for _, s in r.nbest] == sorted((s for _, s in r.nbest), reverse=True)
        assert len(r.nbest) == len({h for h, _ in r.nbest}) == 5  # 5 distinct hypotheses
    assert five[-1].status == "empty" and five[-1].score is None and five[-1].nbest == []

    greedy = tr.translate_batch(src, method="iad")
    assert all(r.score is None for r in greedy)  # the draft-verify loop keeps no log-probs
    tr.rescore(greedy, max_batch_size=5)
    # beam 1 is greedy, and with lenpen 0 its score is the plain sum of log-probs incl. eos
    beam1 = tr.translate_batch(src, method="beam", beam=1, lenpen=0.0)
    assert [r.text for r in beam1] == [r.text for r in greedy]
    assert [r.score for r in greedy[:-1]] == pytest.approx([r.score for r in beam1[:-1]], abs=1e-4)
    assert greedy[-1].score is None and all(r.score < 0 for r in greedy[:-1])

    with pytest.raises(ValueError, match="nbest: not an option of method greedy"):
        decode_options("greedy", nbest=2)
    with pytest.raises(ValueError, match=r"nbest: must be <= beam \(2\)"):
        decode_options("beam", beam=2, nbest=3)
    assert "|method:beam|beam:5|lenpen:1.0|nbest:3|" in decode_options("beam", nbest=3).signature()


def test_distill_spec_errors_name_the_field(tiny_model_dir, tmp_path):
    base = [f"model={tiny_model_dir}", f"input.path={tmp_path}", f"output.dir={tmp_path / 'o'}"]
    spec = load_spec(None, [*base, "kind=distill"])
    assert spec.method == "greedy" and spec.distill.tsv and spec.distill.drop_empty and not spec.nbest
    for override, message in [(["decode.nbest=3"], r'decode\.nbest: needs decode\.method = "beam"'),
                              (["decode.method=beam", "decode.beam=2", "decode.nbest=3"],
                               r"decode\.nbest: must be <= beam \(2\)"),
                              (["decode.method=beam", "decode.nbest=0"], r"decode\.nbest: must be >= 1"),
                              (["distill.max_len_ratio=-1"], r"distill\.max_len_ratio: must be a finite number"),
                              (["distill.min_len_ratio=2", "distill.max_len_ratio=1"],
                               r"distill\.min_len_ratio: 2\.0 is above distill\.max_len_ratio"),
                              (["distill.keep_scores=maybe"], r"distill\.keep_scores: must be bool"),
                              (["distill.tvs=true"], r"distill\.tvs: unknown field")]:
        with pytest.raises(SpecError, match=message):
            load_spec(None, [*base, "kind=distill", *override])
    with pytest.raises(SpecError, match=r'distill: only applies to kind = "distill"'):
        load_spec(None, [*base, "kind=translate", "distill.keep_scores=true"])


def test_filter_reasons_first_match_wins():
    table = pa.table({"src": ["a b", "a b", "a b", "a b", "a b", "", "a b c d", "a b c d", "a b", None],
                      "hyp": ["x", "x", "x\ty", " ", "ok\x85", "", "w", "w w w w w w w w w", "y z", ""],
                      "status": ["error", "truncated", "ok", "ok", "ok", "empty", "ok", "ok", "ok", "empty"],
                      "src_len": [3, 3, 3, 3, 3, 0, 5, 5, 3, 0], "hyp_len": [1, 1, 2, 0, 2, 0, 1, 9, 2, 0]})
    opts = DistillSpec(min_len_ratio=0.5, max_len_ratio=2.0)
    reasons = ["error", "truncated", "control_chars", "empty", "control_chars", "empty", "len_ratio_low",
               "len_ratio_high", "", "empty"]
    assert filter_reasons(table, opts).tolist() == reasons
    out, tsv, counts = distill_table(table, opts)
    assert out.column("kept").to_pylist() == [r == "" for r in reasons] and tsv == b"src\tkd\na b\ty z\n"
    assert counts == {"kept": 1, "filtered": {"error": 1, "truncated": 1, "empty": 3, "control_chars": 2,
                                              "len_ratio_low": 1, "len_ratio_high": 1}}
    lenient = DistillSpec(drop_empty=False, tsv=False)
    assert filter_reasons(table, lenient).tolist() == ["error", "truncated", "control_chars", "", "control_chars",
                                                       "", "", "", "", ""]
    assert distill_table(table, lenient, tsv=lenient.tsv)[1] is None
    assert merge_counts([counts, {"kept": 2, "filtered": {"empty": 1}}]) == {
        "kept": 3, "filtered": {"error": 1, "truncated": 1, "empty": 4, "control_chars": 2, "len_ratio_low": 1,
                                "len_ratio_high": 1}}


@pytest.mark.usefixtures("ray_local")
def test_distill_job_filters_writes_tsv_and_trains_a_drafter(tiny_model_dir, tmp_path):
    inp = write_distill_corpus(tmp_path / "in")
    src = pa.concat_tables(pq.read_table(p) for p in sorted(inp.glob("*.parquet"))).column("src").to_pylist()
    tr = Translator.load(tiny_model_dir)
    ref = tr.translate_batch(["" if s is None else s for s in src], method="greedy")
    tr.rescore(ref)
    ratios = [len(r.tokens) / (r.src_len - 1) if r.src_len > 1 else None for r in ref]
    cut = float(np.median([x for x in ratios if x is not None]))  # drops about half of the decoded rows

    out = tmp_path / "greedy"
    result = run_job(distill_spec(tmp_path, tiny_model_dir, inp, out, f"distill.min_len_ratio={cut}",
                                  "distill.keep_scores=true"))
    table = read_outputs(out)
    assert result.rows == table.num_rows == 2 * ROWS and table.column("n").to_pylist() == list(range(2 * ROWS))
    assert table.column("hyp").to_pylist() == [r.text for r in ref]
    assert table.schema.field("score").type == pa.float64() and "nbest" not in table.column_names
    scores = table.column("score").to_pylist()
    assert [s is None for s in scores] == [r.score is None for r in ref] == [r.status == "empty" for r in ref]
    assert [s for s in scores if s is not None] == pytest.approx([r.score for r in ref if r.score is not None], abs=1e-4)
    expected = [r.status if r.status in ("empty", "truncated_output") else "len_ratio_low" if x < cut else ""
                for r, x in zip(ref, ratios)]
    assert table.column("filter_reason").to_pylist() == expected
    assert table.column("kept").to_pylist() == [e == "" for e in expected]
    assert expected[ROWS + 1: ROWS + 3] == ["empty", "empty"] and 0 < expected.count("len_ratio_low") < 2 * ROWS
    kept = [i for i, e in enumerate(expected) if e == ""]

    # the TSV: one line per kept row, in order, cleaned source; the drafter trainer's reader agrees
    tsv = [out / "part-00000.tsv", out / "part-00001.tsv"]
    merged = tmp_path / "kd.tsv"
    merged.write_text(TSV_HEADER + "".join(p.read_text(encoding="utf-8").split("\n", 1)[1] for p in tsv),
                      encoding="utf-8")
    kd_src, kd_tgt = read_tsv(merged, "src", "kd")
    assert kd_src == [clean_text(src[i]) for i in kept] and kd_tgt == [ref[i].text for i in kept]

    manifest = json.loads((out / "_manifest.json").read_text())
    counts = {"kept": len(kept), "filtered": {r: expected.count(r) for r in ("truncated_output", "empty", "len_ratio_low")
                                              if expected.count(r)}}
    assert manifest["totals"]["distill"] == result.distill == counts
    assert manifest["shards"]["part-00001"]["tsv"] == str(tsv[1]) and manifest["spec"]["kind"] == "distill"
    assert f"kept {len(kept)} pairs" in result.summary_line()

    # a lost TSV means the shard is not committed: only that shard is redone
    tsv[1].unlink()
    rerun = run_job(distill_spec(tmp_path, tiny_model_dir, inp, out, f"distill.min_len_ratio={cut}",
                                 "distill.keep_scores=true"))
    assert rerun.skipped == ["part-00000"] and rerun.committed == ["part-00001"] and tsv[1].is_file()
    with pytest.raises(SpecError, match="different job"):  # other filters, same directory
        run_job(distill_spec(tmp_path, tiny_model_dir, inp, out, "distill.keep_scores=true"))

    heads_train.main(["--verifier", str(tiny_model_dir), "--data", str(merged), "--out", str(tmp_path / "heads"),
                      "--max-minutes", "0.05", "--threads", "1", "--max-tokens", "512", "--warmup", "20",
                      "--block-size", "3", "--hidden", "32", "--log-interval", "1000"])
    assert checkpoint.load_heads(tmp_path / "heads", checkpoint.load(tiny_model_dir).sha).num_heads == 2


@pytest.mark.usefixtures("ray_local")
def test_distill_job_nbest_with_beam(tiny_model_dir, tmp_path):
    inp = write_distill_corpus(tmp_path / "in")
    out = tmp_path / "beam"
    result = run_job(distill_spec(tmp_path, tiny_model_dir, inp, out, "decode.method=beam", "decode.beam=3",
                                  "decode.nbest=3", "distill.keep_scores=true", "distill.tsv=false",
                                  "distill.drop_empty=false"))
    table = read_outputs(out)
    assert table.num_rows == result.rows == 2 * ROWS and not list(out.glob("*.tsv"))
    assert table.schema.field("nbest").type == pa.list_(pa.struct([("hyp", pa.string()), ("score", pa.float64())]))
    ref = Translator.load(tiny_model_dir).translate_batch(
        ["" if s is None else s for s in table.column("src").to_pylist()], method="beam", beam=3, nbest=3)
    for row, r in zip(table.to_pylist(), ref):
        assert [(h["hyp"], h["score"]) for h in row["nbest"]] == [(h, pytest.approx(s, abs=1e-4)) for h, s in r.nbest]
        if r.status == "ok":
            assert len(row["nbest"]) == 3 and row["nbest"][0] == {"hyp": row["hyp"], "score": row["score"]}
        else:
            assert row["nbest"] == [] and row["score"] is None
    reasons = table.column("filter_reason").to_pylist()
    assert reasons == [""] * (2 * ROWS)  # drop_empty off, no ratio limits
    assert "|method:beam|beam:3|lenpen:1.0|nbest:3|" in json.loads((out / "_manifest.json").read_text())["signature"]
