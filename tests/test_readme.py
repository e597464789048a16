"""The README's code blocks run as written, on the shipped models and sample, in a scratch copy of the
checkout (its outputs land there, not in the repository). Blocks under "Bring your own model" and "On a
cluster" need a user's models or a cluster and are not run; the two setup commands at the top are what
CI runs. Where a block uses the user's own files (`en.txt`, `noisy.txt`, `train.tsv`, `valid.tsv`), they
are made from the shipped sample; where it trains, the time budget is cut to seconds."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.xdist_group("readme")  # one scratch checkout: the tools block exports the tour's job
NOT_RUN = ("Bring your own model", "On a cluster")
"""README sections whose blocks need what a test machine lacks (the user's models, a cluster)."""
TRAIN_MINUTES = "0.1"


def blocks() -> list[tuple[str, str, str]]:
    """(section, language, text) of every fenced block of the README, in order."""
    found, section = [], ""
    lines = iter((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    for line in lines:
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif line.startswith("```"):
            body = []
            for inner in lines:
                if inner.startswith("```"):
                    break
                body.append(inner)
            found.append((section, line[3:].strip(), "\n".join(body) + "\n"))
    return found


def _block(section: str, language: str = "bash") -> str:
    [text] = [t for s, lang, t in blocks() if s == section and lang == language]
    return text


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A scratch copy of the checkout: the command line and the examples copied (so that the default
    job's paths, relative to its spec, stay inside it), the packages and each shipped model linked; `aggdec` on the
    PATH is this copy's command line; the user's own files of the tour made from the sample."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copy(REPO / "cli.py", root / "cli.py")
    shutil.copytree(REPO / "examples", root / "examples")
    for name in ("aggdec", "jobs", "cluster"):
        (root / name).symlink_to(REPO / name)
    (root / "models").mkdir()  # the tools train models/mine here, not in the repository
    for model in (REPO / "models").iterdir():
        (root / "models" / model.name).symlink_to(model)
    (root / "bin").mkdir()
    (root / "bin" / "aggdec").write_text(f'#!/bin/sh\nexec {sys.executable} -m cli "$@"\n')
    (root / "bin" / "aggdec").chmod(0o755)
    sample = pq.read_table(REPO / "examples" / "data" / "gec-sample").to_pydict()
    (root / "noisy.txt").write_text("\n".join(sample["src"][:3]) + "\n", encoding="utf-8")
    (root / "en.txt").write_text("The house is small .\nI like the new book .\n", encoding="utf-8")
    pairs = [f"{s}\t{r}\n" for s, r in zip(sample["src"], sample["ref"])]
    (root / "train.tsv").write_text("src\ttgt\n" + "".join(pairs[:260]), encoding="utf-8")
    (root / "valid.tsv").write_text("src\ttgt\n" + "".join(pairs[260:]), encoding="utf-8")
    return root


def _run(checkout: Path, script: str, timeout: float, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{checkout / 'bin'}{os.pathsep}{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    env.update(env_vars)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{script}\n--- stderr:\n{done.stderr[-3000:]}"
    return done


def test_every_readme_block_is_run_or_marked():
    """Each block is one this file runs, the Python API's (tests/test_api.py), the setup commands, or
    in a section of NOT_RUN: a block added elsewhere needs a test here."""
    tested = {("A five-minute tour", "bash"), ("A five-minute tour", "bash2"), ("Python API", "python"),
              ("Corpus jobs", "toml"), ("In your own Ray Data pipeline", "python"), ("", "")}
    seen = []
    for section, language, _ in blocks():
        key = (section, language if (section, language) not in seen else language + "2")
        seen.append((section, language))
        assert key in tested or section in NOT_RUN, f"README block in {section!r} ({language}) is not tested"
    assert _block("", "").split() == ["make", "run", "make", "test"]
    dry = subprocess.run(["make", "-n", "run", "test"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and "aggdec run" in dry.stdout and "pytest" in dry.stdout, dry.stderr


def test_the_tour_runs_as_written(checkout):
    """The tour's first block, line by line: a decode, the default job (a handful of lines on the
    terminal, saying what drafting did, none of Ray's), ERRANT, a greedy job, the comparison, the report."""
    [tour, _] = [t for s, lang, t in blocks() if s == "A five-minute tour"]
    said = {line.split("#")[0].strip(): _run(checkout, line, timeout=300) for line in tour.splitlines()}
    assert "She" in said['echo "She go to school yesterday ." | aggdec decode --method iad'].stdout
    job = said["aggdec run"]
    lines = (job.stdout + job.stderr).strip().splitlines()
    assert len(lines) <= 4 and job.stderr.startswith("3 input file(s), 300 rows; method iad"), lines
    assert re.search(r"^300 rows \(300 ok.*; drafted on \d+% of \d+ verifier calls \(draft_length auto: [^)]+\)",
                     job.stdout), job.stdout
    assert not any("INFO" in line or "core_worker" in line or "Dataset" in line for line in lines), lines
    assert "identical" in said["aggdec eval out/gec-sample --compare out/greedy"].stdout
    assert (checkout / "report.html").stat().st_size > 10_000


def test_the_tools_run_as_written(checkout):
    """The tour's second block on files made from the sample, training for seconds, not an hour."""
    [_, tools] = [t for s, lang, t in blocks() if s == "A five-minute tour"]
    assert "--max-minutes 60" in tools
    script = re.sub(r"--max-minutes \d+", f"--max-minutes {TRAIN_MINUTES}", tools)
    script = re.sub(r"(aggdec train heads [^\n#]*?)(\s*#|\n)", rf"\1 --max-minutes {TRAIN_MINUTES}\2", script)
    if not (checkout / "out" / "gec-sample" / "_manifest.json").exists():  # `aggdec export` reads the tour's job
        _run(checkout, "aggdec run > /dev/null 2>&1", timeout=300)
    _run(checkout, script, timeout=900)
    assert (checkout / "de.txt").read_text().count("\n") == 2
    assert (checkout / "gen.txt").read_text().startswith("S-")
    assert (checkout / "models" / "mine").is_dir() and (checkout / "kd.tsv").exists()
    assert (checkout / "models" / "gec-heads").is_dir()


def test_the_job_spec_and_the_ray_data_stage_run_as_written(checkout):
    """The job spec shown, saved beside the example it abbreviates and run; the Ray Data stage."""
    (checkout / "examples" / "readme.toml").write_text(_block("Corpus jobs", "toml"), encoding="utf-8")
    done = _run(checkout, "aggdec run examples/readme.toml --output out/readme-spec", timeout=300)
    assert "300 rows (300 ok" in done.stdout
    # Ray Data starts Ray as `ray.init()` does, which joins a cluster recorded on this machine (another test's):
    # a machine of the user's, with none, is a new local Ray
    _run(checkout, f"{sys.executable} - <<'EOF'\n{_block('In your own Ray Data pipeline', 'python')}EOF\n", 300,
         RAY_ADDRESS="local")
    assert list((checkout / "out" / "gec-sample-stage").glob("*.parquet"))
