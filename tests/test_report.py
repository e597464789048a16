"""aggdec.report: the HTML page renders from a synthetic output directory; the statistics behind it."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aggdec.report import acceptance_by_position, edit_ratio, length_buckets

CHROMIUM = Path("/usr/bin/chromium")
WORDS = "the a cat dog sat ran on in to of big small red went goes is are was were book books friend .".split()


def synthetic_rows(n: int, method: str, seed: int) -> dict[str, list]:
    """Rows shaped like the corpus pipeline's output: hyp = src with a few word edits; an IAD-like
    decoder accepts each unedited run in one call (accepted_per_iter = run lengths)."""
    rng = random.Random(seed)
    cols: dict[str, list] = {k: [] for k in ("id", "src", "hyp", "ref", "status", "error", "method", "src_len",
                                              "hyp_len", "iterations", "drafted", "accepted", "accepted_per_iter",
                                              "decode_ms")}
    for i in range(n):
        src = [rng.choice(WORDS) for _ in range(rng.randint(3, 60))]
        hyp = list(src)
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
            hyp[rng.randrange(len(hyp))] = rng.choice(WORDS)
        runs, run = [], 0
        for s, h in zip(src, hyp):
            if s == h:
                run += 1
            else:
                runs.append(run)
                run = 0
        runs.append(run)  # the last call also emits eos
        per_iter = runs if method == "iad" else [0] * (len(hyp) + 1)
        cols["id"].append(f"{method}-{seed}:{i}")
        cols["src"].append(" ".join(src))
        cols["hyp"].append(" ".join(hyp))
        cols["ref"].append(" ".join(hyp))
        cols["status"].append("ok" if i % 50 else "error")
        cols["error"].append("" if i % 50 else "boom")
        cols["method"].append(method)
        cols["src_len"].append(len(src) + 1)
        cols["hyp_len"].append(len(hyp))
        cols["iterations"].append(len(per_iter))
        drafted = [max(0, len(src) - sum(runs[:k]) - k) for k in range(len(per_iter))]  # IAD drafts the rest
        cols["drafted"].append(sum(drafted) if method == "iad" else 0)
        cols["accepted"].append(sum(per_iter))
        cols["accepted_per_iter"].append(per_iter)
        cols["decode_ms"].append(0.4 * len(per_iter) + 0.01 * len(src) ** 1.5)
    return cols


def write_output_dir(root: Path, shards: list[tuple[str, int, int]]) -> Path:
    """One Parquet file per (method, rows, seed), with the pipeline's output schema, plus a manifest."""
    root.mkdir(parents=True)
    for k, (method, n, seed) in enumerate(shards):
        cols = synthetic_rows(n, method, seed)
        types = {"src_len": pa.int32(), "hyp_len": pa.int32(), "iterations": pa.int32(), "drafted": pa.int32(),
                 "accepted": pa.int32(), "accepted_per_iter": pa.list_(pa.int32()), "decode_ms": pa.float64()}
        pq.write_table(pa.table({c: pa.array(v, types.get(c, pa.string())) for c, v in cols.items()}),
                       root / f"part-{k:05d}.parquet")
    manifest = {"format": "aggdec-job-manifest v1", "complete": True, "signature": "aggdec|method:iad|test",
                "model": {"path": "models/tiny", "sha": "0123abcd"}, "aggdec_version": "0.1.0",
                "shards": {f"part-{k:05d}": {"rows": n} for k, (_, n, _) in enumerate(shards)},
                "timings": {"pipeline_s": 4.0}, "run": {"committed": [f"part-{k:05d}" for k in range(len(shards))]}}
    (root / "_manifest.json").write_text(json.dumps(manifest))
    return root


def write_bench(path: Path) -> Path:
    runs = [{"method": m, "batch_size": bs, "sentences": 100, "sentences_per_s": sps * bs ** 0.6,
             "tokens_per_s": 20 * sps * bs ** 0.6, "identical": 1.0 if m != "beam" else 0.9,
             **({"calls_per_sentence": 6.1} if m == "iad" else {})}
            for m, sps in (("greedy", 5.0), ("iad", 17.0), ("beam", 2.0)) for bs in (1, 8, 32)]
    path.write_text(json.dumps({"model": "models/tiny", "runs": runs}))
    return path


def test_edit_ratio():
    assert edit_ratio("a b c d", "a b c d") == 0.0
    assert edit_ratio("a b c d", "a x c d") == 0.25
    assert edit_ratio("a b c d", "a b") == 0.5
    assert edit_ratio("", "") == 0.0


def test_acceptance_by_position():
    out = acceptance_by_position([[3, 0], [1, 2]], max_position=4)
    assert out["calls"] == 4
    assert out["survival"] == [0.75, 0.5, 0.25, 0.0]
    assert out["conditional"][:3] == [0.75, 2 / 3, 0.5] and out["conditional"][3] == 0.0
    assert acceptance_by_position([], 2)["conditional"] == [None, None]


def test_length_buckets():
    out = length_buckets(np.array([5, 8, 15, 500]), np.array([4, 7, 14, 9]), np.array([1000.0, 1000.0, 500.0, 10.0]),
                         edges=(0, 10, 20))
    assert [b["bucket"] for b in out] == ["1-10", "11-20", ">20"]
    assert out[0]["sentences"] == 2 and out[0]["tokens"] == 13 and out[0]["sentences_per_s"] == 1.0
    assert out[1]["tokens_per_s"] == 30.0


def test_report_renders(tmp_path: Path):
    pytest.importorskip("matplotlib")
    from aggdec.report import build_report

    out_dir = write_output_dir(tmp_path / "out", [("iad", 120, 1), ("iad", 80, 2)])
    page = build_report(out_dir, [write_bench(tmp_path / "bench.json")])
    images = re.findall(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == page.count("<img") == 5
    assert "aggdec|method:iad|test" in page and "error: 5" in page
    # wall-clock first, under the name the job summary uses; decoder time named as such
    assert "decoded 200 rows: wall 4.0 s, 50.0 sentences/s" in page and "sentences / s of decoder time" in page
    assert "decode s" not in page
    assert build_report(out_dir).count("<img") == 4  # no benchmark plot without --bench

    html_file = tmp_path / "report.html"
    html_file.write_text(page, encoding="utf-8")
    if not CHROMIUM.exists():
        return
    # Probe copy: after load, record for every image whether the browser decoded it.
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", "<script>window.addEventListener('load', () => {"
                                  "document.body.setAttribute('data-loaded', JSON.stringify("
                                  "[...document.images].map(i => i.complete && i.naturalWidth > 0)));});"
                                  "</script></body>"), encoding="utf-8")
    profile = tmp_path / "chromium-profile"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}"]
    dom = subprocess.run([str(CHROMIUM), *flags, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)
    shutil.rmtree(profile, ignore_errors=True)
    found = re.search(r'data-loaded="([^"]*)"', dom.stdout)
    assert found, f"chromium did not run the probe: rc {dom.returncode}, stderr {dom.stderr[-2000:]}"
    assert json.loads(found.group(1).replace("&quot;", '"')) == [True] * 5


def test_report_says_what_drafting_did_and_times_against_greedy(tmp_path: Path):
    """The summary gives the share of verifier calls that drafted and the budget's reason (the
    manifest's totals); `compare` adds decoder time against a greedy output of the same ids, and calls
    saved are labelled as not time."""
    pytest.importorskip("matplotlib")
    from aggdec.report import build_report

    out_dir = write_output_dir(tmp_path / "out", [("iad", 120, 1)])
    manifest = json.loads((out_dir / "_manifest.json").read_text())
    why = "8 tokens a row; no draft measured 0.80x its output tokens/s"
    manifest["totals"] = {"drafting": {"calls": 400, "drafting_calls": 100, "budget": [why]}}
    (out_dir / "_manifest.json").write_text(json.dumps(manifest))
    greedy = tmp_path / "greedy"
    greedy.mkdir()
    table = pq.read_table(out_dir / "part-00000.parquet")
    slower = pa.compute.multiply(table.column("decode_ms"), 3.0)
    pq.write_table(table.set_column(table.schema.get_field_index("decode_ms"), "decode_ms", slower),
                   greedy / "part-00000.parquet")
    text = re.sub(r"<[^>]+>", " ", build_report(out_dir, compare=greedy))
    assert "drafting 25% of 400 verifier calls carried a draft (draft_length auto)" in " ".join(text.split())
    assert why in text
    assert "calls saved, not time" in text and "speedup" not in text.lower()
    row = re.search(rf"{re.escape(str(out_dir))}\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", text)
    assert row and row.group(1) == "117" and row.group(3) == "3.00" and row.group(4) == "1.00", text
    with pytest.raises(ValueError, match="no decoded row shares an id"):
        build_report(out_dir, compare=write_output_dir(tmp_path / "other", [("iad", 10, 7)]))


def test_report_without_ok_rows_names_the_directory(tmp_path: Path):
    pytest.importorskip("matplotlib")
    from aggdec.report import build_report

    out_dir = tmp_path / "bad"
    out_dir.mkdir()
    pq.write_table(pa.table({c: pa.array([], pa.string()) for c in ("src", "hyp", "status", "method")} |
                            {c: pa.array([], pa.int32()) for c in ("src_len", "hyp_len", "iterations", "drafted",
                                                                   "accepted")} |
                            {"accepted_per_iter": pa.array([], pa.list_(pa.int32())),
                             "decode_ms": pa.array([], pa.float64())}), out_dir / "part-00000.parquet")
    with pytest.raises(ValueError, match="bad: no rows with status ok/truncated"):
        build_report(out_dir)


def test_report_with_equal_length_call_lists(tmp_path: Path):
    """Rows whose accepted_per_iter lists all have one length (e.g. beam: zeros) stay one list per row."""
    pytest.importorskip("matplotlib")
    from aggdec.report import build_report

    out_dir = tmp_path / "beam"
    out_dir.mkdir()
    n = 3
    pq.write_table(pa.table({"src": ["a b"] * n, "hyp": ["a c"] * n, "status": ["ok"] * n, "method": ["beam"] * n,
                             **{c: pa.array([2] * n, pa.int32()) for c in ("src_len", "hyp_len", "iterations")},
                             **{c: pa.array([0] * n, pa.int32()) for c in ("drafted", "accepted")},
                             "accepted_per_iter": pa.array([[0, 0]] * n, pa.list_(pa.int32())),
                             "decode_ms": [1.0] * n}), out_dir / "part-00000.parquet")
    assert build_report(out_dir).count("<img") == 4


def test_report_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch):
    import sys

    from aggdec.report import build_report

    out_dir = write_output_dir(tmp_path / "out", [("iad", 5, 1)])
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"matplotlib: pip install .*\[report\]'$"):
        build_report(out_dir)


def test_cli_report(tmp_path: Path):
    pytest.importorskip("matplotlib")
    from click.testing import CliRunner

    from cli import main

    out_dir = write_output_dir(tmp_path / "out", [("iad", 20, 1)])
    page = tmp_path / "report.html"
    res = CliRunner().invoke(main, ["report", str(out_dir), "--bench", str(write_bench(tmp_path / "b.json")),
                                    "--out", str(page)])
    assert res.exit_code == 0, res.output
    assert page.read_text(encoding="utf-8").count("data:image/png;base64,") == 5
    res = CliRunner().invoke(main, ["report", str(out_dir), "--bench", str(out_dir / "_manifest.json")])
    assert res.exit_code == 2 and "no measured 'runs'" in res.output
