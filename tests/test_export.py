"""aggdec.export: fairseq-generate-style text from an output directory."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aggdec.export import fairseq_lines


def _shard(path: Path, ids: list[str], **extra) -> None:
    n = len(ids)
    cols = {"id": ids, "src": [f"src {i}" for i in ids], "hyp": [f"hyp {i}" for i in ids], **extra,
            "status": ["ok"] * n, "iterations": pa.array([3] * n, pa.int32()),
            "accepted_per_iter": pa.array([[2, 0, 1]] * n, pa.list_(pa.int32()))}
    pq.write_table(pa.table(cols), path)


def test_fairseq_lines_in_natural_id_order(tmp_path: Path):
    _shard(tmp_path / "part-00001.parquet", ["p:10", "p:2"], ref=["r 10", "r\t2"])
    _shard(tmp_path / "part-00000.parquet", ["p:1"], ref=["r 1"])
    lines = list(fairseq_lines(tmp_path, ref_column="ref"))
    assert lines[:5] == ["S-p:1\tsrc p:1", "T-p:1\tr 1", "H-p:1\t0\thyp p:1", "D-p:1\t0\thyp p:1", "I-p:1\t3\t2 0 1"]
    assert [line.split("\t")[0] for line in lines if line.startswith("S-")] == ["S-p:1", "S-p:2", "S-p:10"]
    assert "T-p:2\tr 2" in lines  # a tab inside text becomes a space
    assert len(list(fairseq_lines(tmp_path))) == 3 * 4  # no T lines without a reference column


def test_fairseq_lines_use_score_column(tmp_path: Path):
    _shard(tmp_path / "a.parquet", ["0"], score=[-0.25])
    assert list(fairseq_lines(tmp_path))[1:3] == ["H-0\t-0.25\thyp 0", "D-0\t-0.25\thyp 0"]


def test_fairseq_lines_missing_column_names_file(tmp_path: Path):
    _shard(tmp_path / "a.parquet", ["0"])
    with pytest.raises(ValueError, match=r"a\.parquet: no column 'ref'"):
        list(fairseq_lines(tmp_path, ref_column="ref"))


def test_cli_export(tmp_path: Path):
    from click.testing import CliRunner

    from cli import main

    _shard(tmp_path / "a.parquet", ["1", "0"])
    out = tmp_path / "generate.txt"
    res = CliRunner().invoke(main, ["export", str(tmp_path), "--format", "fairseq", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_text(encoding="utf-8").splitlines()[::4] == ["S-0\tsrc 0", "S-1\tsrc 1"]


def test_ids_with_control_characters_are_escaped(tmp_path: Path):
    ids = ["a\nb", "a\\nb", "tab\there", "nul\x00", "ls\u2028x", "caf\u00e9 ok"]
    _shard(tmp_path / "a.parquet", ids)
    out = tmp_path / "generate.txt"
    from click.testing import CliRunner

    from cli import main

    res = CliRunner().invoke(main, ["export", str(tmp_path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text(encoding="utf-8")
    lines = text.split("\n")[:-1]
    assert len(lines) == 4 * len(ids) and lines == text.splitlines()  # one record per line, nothing else breaks one
    heads = {line.split("\t")[0] for line in lines if line.startswith("S-")}
    assert heads == {"S-a\\nb", "S-a\\\\nb", "S-tab\\there", "S-nul\\x00", "S-ls\\u2028x", "S-caf\u00e9 ok"}
    assert all(len(line.split("\t")) == (3 if line[0] in "HDI" else 2) for line in lines)
