"""aggdec.evaluate: sacrebleu/ERRANT scores reproduce the reference tools; readers; losslessness."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aggdec.evaluate import bleu_chrf, compare_outputs, f_score, read_lines
from aggdec.schema import id_sort_key, read_by_id, read_outputs

HYPS = ["the cat sat on the mat", "a quick brown fox jumps"]
REFS = ["the cat sat on a mat", "the quick brown fox jumped"]


def test_bleu_chrf_match_sacrebleu():
    from sacrebleu.metrics import BLEU, CHRF

    out = bleu_chrf(HYPS, REFS)
    assert out["bleu"] == BLEU().corpus_score(HYPS, [REFS]).score
    assert out["chrf"] == CHRF().corpus_score(HYPS, [REFS]).score
    # by hand: clipped n-gram matches 8/11, 5/9, 3/7, 1/5; 11 hyp tokens = 11 ref tokens, so BP = 1
    assert out["bleu"] == pytest.approx(100 * (8 / 11 * 5 / 9 * 3 / 7 * 1 / 5) ** 0.25, abs=1e-9)
    assert out["bleu"] == pytest.approx(43.1389, abs=1e-4)
    assert out["bleu_bp"] == 1.0 and out["sys_len"] == out["ref_len"] == 11
    assert out["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert out["chrf_signature"].startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:")


def test_bleu_chrf_identical_is_100_and_length_mismatch_raises():
    out = bleu_chrf(REFS, REFS)
    assert out["bleu"] == pytest.approx(100.0) and out["chrf"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="hyps 1, refs 2"):
        bleu_chrf(HYPS[:1], REFS)


def test_f_score_follows_errant_conventions():
    assert f_score(0, 0, 0) == (1.0, 1.0, 1.0)
    assert f_score(0, 1, 0) == (0.0, 1.0, 0.0)
    p, r, f = f_score(2, 1, 3)
    assert (p, r) == (2 / 3, 2 / 5) and f == pytest.approx(1.25 * p * r / (0.25 * p + r))


GEC_SRC = ["This are a test .", "He go to school yesterday .", "Nothing wrong here .", "", "I has a apple ."]
GEC_REF = ["This is a test .", "He went to school yesterday .", "Nothing wrong here .", "", "I have an apple ."]
GEC_HYP = ["This is a test .", "He goes to school yesterday .", "Nothing wrong there .", "x", "I have a apple ."]


def test_gec_scores_fixed_example():
    pytest.importorskip("errant")
    from aggdec.evaluate import gec_scores

    out = gec_scores(GEC_SRC, GEC_HYP, GEC_REF)
    # by hand: are->is TP; go->goes FP + go->went FN; here->there FP; empty source skipped;
    # has->have TP, a->an FN
    assert (out["tp"], out["fp"], out["fn"]) == (2, 2, 2)
    assert out["precision"] == 0.5 and out["recall"] == 0.5 and out["f0.5"] == pytest.approx(0.5)
    assert out["sentences"] == 5 and out["scored"] == 4
    assert out["exact_match"] == pytest.approx(1 / 5)
    assert "|eval:span-correction|beta:0.5" in out["signature"]


def _errant_compare(src: list[str], hyp: list[str], ref: list[str]) -> tuple[int, int, int]:
    """errant_parallel (hyp and ref M2) + errant_compare's functions, as its command line runs them."""
    from errant.commands import compare_m2

    from aggdec.evaluate import _errant_annotator

    annotator = _errant_annotator()

    def to_m2(cors: list[str]) -> list[str]:
        blocks = []
        for o, c in zip(src, cors):
            if not o.strip():
                continue
            orig = annotator.parse(o.strip())
            lines = ["S " + " ".join(t.text for t in orig)]
            if orig.text.strip() == c.strip():
                lines.append("A -1 -1|||noop|||-NONE-|||REQUIRED|||-NONE-|||0")
            else:
                lines += [e.to_m2(0) for e in annotator.annotate(orig, annotator.parse(c.strip()))]
            blocks.append("\n".join(lines))
        return blocks

    args = argparse.Namespace(beta=0.5, verbose=False, dt=False, ds=False, cs=False, cse=False, single=False,
                              multi=False, filt=[], cat=None)
    best = {"tp": 0, "fp": 0, "fn": 0}
    for h, r in zip(to_m2(hyp), to_m2(ref)):
        hyp_dict = compare_m2.process_edits(compare_m2.simplify_edits(h), args)
        ref_dict = compare_m2.process_edits(compare_m2.simplify_edits(r), args)
        counts, _ = compare_m2.evaluate_edits(hyp_dict, ref_dict, best, 0, "", args)
        best = {k: best[k] + counts[k] for k in best}
    return best["tp"], best["fp"], best["fn"]


def test_gec_scores_equal_errant_compare():
    pytest.importorskip("errant")
    from aggdec.evaluate import gec_scores

    src = GEC_SRC + ["She do n't like apples and oranges .", "Their going too the park ."]
    ref = GEC_REF + ["She does n't like apples and oranges .", "They 're going to the park ."]
    hyp = GEC_HYP + ["She doesn't like apple and oranges .", "They 're going to the park ."]
    out = gec_scores(src, hyp, ref)
    assert (out["tp"], out["fp"], out["fn"]) == _errant_compare(src, hyp, ref)


def test_gec_scores_tokenise_splits_punctuation():
    pytest.importorskip("errant")
    from aggdec.evaluate import gec_scores

    out = gec_scores(["He go home."], ["He goes home."], ["He went home."], tokenise=True)
    assert (out["tp"], out["fp"], out["fn"]) == (0, 1, 1)
    assert "|tok:spacy|" in out["signature"]


def test_compare_outputs():
    a = {"s:0": "x", "s:1": "y", "s:2": "z", "s:10": "w", "only-a": "q"}
    b = {"s:0": "x", "s:1": "Y", "s:2": "z", "s:10": "W", "only-b": "q"}
    out = compare_outputs(a, b, examples=1)
    assert (out["a_rows"], out["b_rows"], out["common"], out["identical"], out["different"]) == (5, 5, 4, 2, 2)
    assert out["identical_share"] == 0.5
    assert out["missing_in_a"] == ["only-b"] and out["missing_in_b"] == ["only-a"]
    assert out["examples"] == [{"id": "s:1", "a": "y", "b": "Y"}]
    assert compare_outputs({}, {})["identical_share"] == 1.0


def test_id_sort_key_is_natural():
    ids = ["p-1:10", "p-1:2", "p-0:7", "9", "10"]
    assert sorted(ids, key=id_sort_key) == ["9", "10", "p-0:7", "p-1:2", "p-1:10"]


def _write_shard(path: Path, ids: list[str], hyps: list[str | None]) -> None:
    pq.write_table(pa.table({"id": ids, "src": ["s"] * len(ids), "hyp": pa.array(hyps, pa.string())}), path)


def test_readers(tmp_path: Path):
    _write_shard(tmp_path / "part-00001.parquet", ["b"], [None])
    _write_shard(tmp_path / "part-00000.parquet", ["a"], ["A"])
    assert read_outputs(tmp_path).column("id").to_pylist() == ["a", "b"]
    assert read_by_id(tmp_path) == {"a": "A", "b": ""}
    with pytest.raises(ValueError, match=r"part-00000\.parquet: no column 'ref'"):
        read_outputs(tmp_path, ["id", "ref"])
    _write_shard(tmp_path / "part-00002.parquet", ["a"], ["again"])
    with pytest.raises(ValueError, match="id 'a' occurs more than once"):
        read_by_id(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no \*\.parquet files"):
        read_outputs(tmp_path / "empty")
    text = tmp_path / "hyp.txt"
    text.write_text("one\r\ntwo\n\nfour\n", encoding="utf-8")
    assert read_lines(text) == ["one", "two", "", "four"]


def test_bleu_is_finite_on_empty_hypotheses():
    assert math.isfinite(bleu_chrf(["", ""], REFS)["bleu"])


def test_gec_scores_without_errant_names_the_extra(monkeypatch):
    import sys

    from aggdec.evaluate import _errant_annotator, gec_scores

    _errant_annotator.cache_clear()
    monkeypatch.setitem(sys.modules, "errant", None)
    try:
        with pytest.raises(ImportError, match=r"needs ERRANT: pip install .*\[gec\]' \(errant"):
            gec_scores(["a"], ["a"], ["a"])
    finally:
        _errant_annotator.cache_clear()


def test_cli_eval_translation_and_compare(tmp_path: Path):
    import json

    from click.testing import CliRunner

    from cli import main

    for name, hyps in (("a", HYPS), ("b", [HYPS[0], "something else"])):
        (tmp_path / name).mkdir()
        table = pa.table({"id": ["0", "1"], "src": ["x", "y"], "hyp": hyps, "ref": REFS, "status": ["ok", "ok"]})
        pq.write_table(table, tmp_path / name / "part-00000.parquet")
    scores = tmp_path / "scores.json"
    res = CliRunner().invoke(main, ["eval", str(tmp_path / "a"), "--task", "translation", "--json", str(scores)])
    assert res.exit_code == 0, res.output
    assert "BLEU   43.14" in res.output and "chrF" in res.output
    assert json.loads(scores.read_text())["scores"]["bleu"] == pytest.approx(43.1389, abs=1e-4)

    res = CliRunner().invoke(main, ["eval", str(tmp_path / "a"), "--compare", str(tmp_path / "b")])
    assert res.exit_code == 1 and "1/2 shared ids identical" in res.output and "--- 1" in res.output
    res = CliRunner().invoke(main, ["eval", str(tmp_path / "a"), "--compare", str(tmp_path / "a")])
    assert res.exit_code == 0 and "2/2 shared ids identical (100.00%)" in res.output

    res = CliRunner().invoke(main, ["eval", str(tmp_path / "a")])
    assert res.exit_code == 2 and "give --task" in res.output
    (tmp_path / "a" / "_manifest.json").write_text(json.dumps({"spec": {"kind": "translate"}}))
    res = CliRunner().invoke(main, ["eval", str(tmp_path / "a")])  # the task follows the job's kind
    assert res.exit_code == 0 and "BLEU   43.14" in res.output
    res = CliRunner().invoke(main, ["eval", str(tmp_path / "a"), "--task", "translation", "--ref-column", "gold"])
    assert res.exit_code == 2 and "no column 'gold'" in res.output


def test_cli_eval_text_files(tmp_path: Path):
    from click.testing import CliRunner

    from cli import main

    (tmp_path / "hyp.txt").write_text("\n".join(HYPS) + "\n", encoding="utf-8")
    (tmp_path / "ref.txt").write_text("\n".join(REFS) + "\n", encoding="utf-8")
    args = ["eval", "--hyp", str(tmp_path / "hyp.txt"), "--ref", str(tmp_path / "ref.txt")]
    res = CliRunner().invoke(main, [*args, "--task", "translation"])
    assert res.exit_code == 0 and "BLEU   43.14" in res.output
    res = CliRunner().invoke(main, [*args, "--task", "gec"])
    assert res.exit_code == 2 and "--src FILE" in res.output
