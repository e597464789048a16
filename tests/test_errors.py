"""Bad input is refused early with one line naming the culprit; a job's terminal output is short;
signals stop a job cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from conftest import synthetic_sentences
from test_jobs import write_corpus

from cli import main
from jobs.preflight import check_job
from jobs.run import run_job
from jobs.spec import SpecError, load_spec

REPO = Path(__file__).resolve().parent.parent
AGGDEC = [sys.executable, "-c", "import sys; sys.argv[0] = 'aggdec'; from cli import run; run()"]


def _run(args: list[str]):
    res = CliRunner().invoke(main, args)
    return res.exit_code, res.output


def _spec(model, inp, out, *extra):
    return load_spec(None, [f"model={model}", f"input.path={inp}", f"output.dir={out}", *extra])


def test_output_locations_that_cannot_be_written(tiny_model_dir, tmp_path, monkeypatch):
    inp = write_corpus(tmp_path / "in", shards=1, rows=3)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpecError, match=r"^output\.dir: .*/file/out: cannot be written \("):
        check_job(_spec(tiny_model_dir, inp, tmp_path / "file" / "out"))
    with pytest.raises(SpecError, match=r"^output\.dir: /proc/aggdec-out: cannot be written"):
        check_job(_spec(tiny_model_dir, inp, "/proc/aggdec-out"))
    monkeypatch.setattr("jobs.preflight.OUTPUT_BYTES_PER_INPUT_BYTE", 1e15)  # a disk far too small
    with pytest.raises(SpecError, match=r"^output\.dir: .*: [\d.]+ MB free, the output needs about [\d.]+ MB$"):
        check_job(_spec(tiny_model_dir, inp, tmp_path / "out"))


@pytest.mark.parametrize("damage, message", [
    (lambda c: c.update(model=[1, 2]), r"config\.json: model: missing or not an object"),
    (lambda c: c["model"].pop("src_vocab"), r"config\.json: model\.src_vocab: missing"),
    (lambda c: c["model"].update(d_model="256"), r"config\.json: model\.d_model: must be int, got '256'"),
    (lambda c: c["tokenizer"].pop("src"), r"config\.json: tokenizer\.src: missing"),
    (lambda c: c.update(format="v0"), r"config\.json: format is 'v0'"),
])
def test_malformed_model_configs_are_named(tiny_model_dir, tmp_path, damage, message):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    damage(config)
    (model / "config.json").write_text(json.dumps(config))
    code, out = _run(["decode", "-m", str(model)])
    assert code == 2 and out.count("\n") == 1 and out.startswith("aggdec: error: ")
    assert __import__("re").search(message, out), out
    with pytest.raises(SpecError, match=f"^model: .*{message}"):
        check_job(_spec(model, write_corpus(tmp_path / "in", shards=1, rows=2), tmp_path / "out"))


def test_a_corrupt_tokenizer_is_named(tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "spm.model").write_bytes(b"not a sentencepiece model")
    code, out = _run(["decode", "-m", str(model)])
    assert code == 2 and out.count("\n") == 1
    assert f"aggdec: error: {model / 'spm.model'}: not a readable sentencepiece model" in out


def test_options_out_of_range_are_refused_before_anything_runs(tiny_model_dir, tmp_path):
    code, out = _run(["run", "--set", "decode.max_len_a=-1", "--output", str(tmp_path / "o")])
    assert code == 2 and "decode.max_len_a: must be >= 0, got -1.0" in out and out.count("\n") == 1
    assert not (tmp_path / "o").exists()
    code, out = _run(["decode", "--max-len-b", "-3"])
    assert code == 2 and "-3 is not in the range x>=0" in out


def test_duplicate_ids_warn_or_refuse_and_stray_files_warn(tiny_model_dir, tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    for k in range(2):
        pq.write_table(pa.table({"src": synthetic_sentences(3, seed=k), "id": ["a", f"b{k}", "c"]}),
                       inp / f"part-{k}.parquet")
    (inp / "README.txt").write_text("notes")
    warnings: list[str] = []
    shards = check_job(_spec(tiny_model_dir, inp, tmp_path / "out", "input.id_column=id"), warn=warnings.append)
    assert len(shards) == 2
    assert any("input.id_column: 2 id(s) occur more than once" in w and "'a'" in w for w in warnings)
    assert any("ignoring 1 file(s) that are not *.parquet: README.txt" in w for w in warnings)
    with pytest.raises(SpecError, match=r'input\.id_column: 2 id\(s\) occur more than once .*input\.duplicate_ids'):
        check_job(_spec(tiny_model_dir, inp, tmp_path / "out", "input.id_column=id", "input.duplicate_ids=error"))


def test_jobs_commands_give_one_line_errors():
    code, out = _run(["status", "raysubmit_nope", "--address", "http://127.0.0.1:1"])
    assert code == 2 and out.count("\n") == 1 and out.startswith("aggdec: error: --address http://127.0.0.1:1: ")
    code, out = _run(["logs", "raysubmit_nope", "--address", "http://127.0.0.1:1"])
    assert code == 2 and out.count("\n") == 1


def _foreground() -> None:
    """In the child: SIGINT as a terminal's foreground job has it, also where the suite itself runs as a
    shell's background job (which starts its commands with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _job_under_way(model: Path, tmp_path: Path, seed: int, **popen) -> tuple[subprocess.Popen, Path]:
    """`aggdec run` of 2,000 rows in units of 10 on an embedded Ray, once its first unit committed ->
    (its process, its output location)."""
    inp = write_corpus(tmp_path / "in", shards=1, rows=2000, seed=seed)
    out = tmp_path / "out"
    proc = subprocess.Popen([*AGGDEC, "run", "--output", str(out), "--model", str(model), "--input", str(inp),
                             "--set", "batching.rows_per_task=10", "--set", "input.id_column=none",
                             "--method", "greedy"], env=dict(os.environ, RAY_AUTH_MODE="disabled"), cwd=REPO, **popen)
    deadline = time.time() + 120
    while not list(out.glob("_SUCCESS.*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    return proc, out


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_stops_a_job_cleanly_with_the_shells_exit_status(tiny_model_dir, tmp_path, signum):
    psutil = pytest.importorskip("psutil")
    proc, out = _job_under_way(tiny_model_dir, tmp_path, 3, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_foreground)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr  # 143 for SIGTERM, 130 for SIGINT, as shells report them
    last = stderr.strip().splitlines()[-1]
    assert last == (f"aggdec: stopped ({signal.Signals(signum).name}); committed units are kept in {out}, "
                    "rerun to resume"), stderr
    assert "Traceback" not in stderr
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline()[:3] for p in alive]
    assert 1 <= len(list(out.glob("_SUCCESS.*"))) < 200


def test_a_killed_job_leaves_no_process_behind(tiny_model_dir, tmp_path):
    """SIGKILL of `aggdec run` mid-job on an embedded Ray: within 10 s no process it started is left
    (Ray's agents outlived it by about a minute, reporting the raylet's death to a GCS that was gone;
    `cluster.reaper` ends them)."""
    psutil = pytest.importorskip("psutil")
    proc, _ = _job_under_way(tiny_model_dir, tmp_path, 5, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = psutil.Process(proc.pid).children(recursive=True)
    assert any("DashboardAgent" in " ".join(p.cmdline()) for p in started), [p.cmdline()[:2] for p in started]
    proc.kill()
    proc.wait(timeout=30)
    killed = time.time()

    def alive() -> list:
        return [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    while alive() and time.time() < killed + 10:
        time.sleep(0.2)
    assert not alive(), [p.cmdline()[:2] for p in alive()]


def test_two_jobs_started_at_once_on_one_output_one_is_refused_before_ray_starts(tiny_model_dir, tmp_path):
    """Two `aggdec run`s on one output location started at the same moment: both pass the checks, the lease
    is taken before Ray starts, so one is refused (exit 2, one line naming the other job) without starting
    Ray (no plan line), while the other runs; it stops cleanly on SIGTERM."""
    inp = write_corpus(tmp_path / "in", shards=1, rows=2000, seed=4)
    out = tmp_path / "out"
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    cmd = [*AGGDEC, "run", "--output", str(out), "--model", str(tiny_model_dir), "--input", str(inp),
           "--set", "batching.rows_per_task=10", "--set", "input.id_column=none", "--method", "greedy"]
    t0 = time.time()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                              preexec_fn=_foreground) for _ in range(2)]
    deadline = t0 + 120
    while all(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.05)
    seconds = time.time() - t0
    refused = next(p for p in procs if p.poll() is not None)
    running = next(p for p in procs if p is not refused)
    stderr = refused.communicate(timeout=30)[1]
    running.send_signal(signal.SIGTERM)
    running.communicate(timeout=120)
    assert refused.returncode == 2, stderr
    assert re.search(rf"output\.dir: {re.escape(str(out))} is in use by another job \(pid {running.pid} ", stderr), stderr
    assert "actor(s) on" not in stderr  # refused before the plan line
    # both processes' start and the spec and footers read, before torch loads: about 1 s here (4 s with the lease
    # after the checks, 15 s with it after Ray)
    assert seconds < 3, seconds
    assert running.returncode == 128 + signal.SIGTERM


def test_only_options_the_user_set_are_noted_as_ignored(tmp_path):
    """`aggdec run --set decode.method=greedy` on the embedded default spec notes nothing (IAD's
    options there are the spec's, not the user's); options the user set on the command line or in
    their own spec are noted."""
    from cli import DEFAULT_SPEC, _ignored_options, _overrides

    overrides = _overrides(("decode.method=greedy",))
    job = load_spec(DEFAULT_SPEC, overrides)
    assert "draft_cap" in job.unused_options and _ignored_options(job, False, overrides) == []
    overrides = _overrides(("decode.draft_cap=8",), method="greedy")
    assert _ignored_options(load_spec(DEFAULT_SPEC, overrides), False, overrides) == ["draft_cap"]
    own = tmp_path / "job.toml"
    own.write_text(f'model = "{REPO / "models" / "gec-base"}"\n[input]\npath = "in"\n[output]\ndir = "out"\n'
                   '[decode]\nmethod = "iad"\ndraft_cap = 8\nsubstitution = true\n', encoding="utf-8")
    overrides = _overrides((), method="greedy")
    assert _ignored_options(load_spec(own, overrides), True, overrides) == ["draft_cap", "substitution"]


def test_missing_extras_name_the_install_command_for_this_copy(tmp_path, monkeypatch):
    """From a source tree the hint is an editable install of that tree ("." when it is the current
    directory); from an installed package, the package's extra."""
    from aggdec import extras

    monkeypatch.chdir(REPO)
    assert extras.install_hint("gec") == "pip install --no-build-isolation -e '.[gec]'"
    monkeypatch.chdir(tmp_path)
    assert extras.install_hint("report") == f"pip install --no-build-isolation -e '{REPO}[report]'"
    monkeypatch.setattr(extras, "SOURCE_TREE", tmp_path / "site-packages")
    assert extras.install_hint("gec") == "pip install 'aggdec[gec]'"


def test_the_job_summary_names_each_figure_once_wall_clock_first():
    """Wall-clock time and rate of this run first, then the decoder time under its own name; the
    backend and the actors it decoded on, with the seconds spent compiling where any compiled; the
    acceptance figure only where the method drafted."""
    from jobs.run import JobResult

    result = JobResult(output_dir="out", manifest="out/_manifest.json", rows=300, status={"ok": 300},
                       decoded_rows=300, pipeline_seconds=17.6, decoder_seconds=4.3, decoder_sentences=300)
    line = result.summary_line()
    assert "; decoded 300: wall 17.6 s, 17.0 sentences/s; decoder time 4.30 s (69.8 sentences/s of decoder time)" in line
    assert "accepted" not in line
    assert "backend" not in line  # (records of aggdec versions that did not say)
    result.drafted, result.mean_accepted_per_iter = 900, 2.5
    assert "; mean accepted draft tokens per verifier call 2.50;" in result.summary_line()
    result.backends = {"eager": 1}
    assert "(69.8 sentences/s of decoder time); backend eager on 1 actor;" in result.summary_line()
    result.backends, result.compile_seconds = {"compiled": 2, "eager": 1}, 51.24
    assert "; backend compiled on 2 actors, eager on 1, compiling 51.2 s;" in result.summary_line()
    result.drafting = {"calls": 512, "drafting_calls": 15, "budget": ["no draft; 16 tokens a row measured 0.74x its "
                                                                    "output tokens/s"]}
    assert ("; drafted on 3% of 512 verifier calls (draft_length auto: no draft; 16 tokens a row measured 0.74x its "
            "output tokens/s); mean accepted") in result.summary_line()


def test_bad_input_exits_2_and_the_codes_are_documented(tmp_path):
    proc = subprocess.run([*AGGDEC, "run", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == f"aggdec: error: input.path: {tmp_path / 'missing'} does not exist\n"
    usage = subprocess.run([*AGGDEC, "--help"], capture_output=True, text=True, cwd=REPO, timeout=120).stdout
    assert re.search(r"Exit status:\n\s+0\s+done\n", usage)
    for code, what in ((2, "bad input"), (130, "SIGINT"), (143, "SIGTERM")):
        assert re.search(rf"\n\s+{code}\s+.*{what}", usage), usage


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_output_that_overlaps_an_input_is_refused_and_the_inputs_are_untouched(tiny_model_dir, tmp_path):
    from jobs.commit import OutputDir
    from jobs.inputs import check_output_apart, input_locations, inspect_inputs

    inp = write_corpus(tmp_path / "in", shards=3, rows=4)
    before = _snapshot(inp)
    (tmp_path / "link").symlink_to(inp)
    cases = [(inp, "is"), (inp / "out", "is inside"), (tmp_path, "contains"), (tmp_path / "link", "is"),
             (tmp_path / "link" / "sub", "is inside")]
    for out, how in cases:
        code, text = _run(["run", "--model", str(tiny_model_dir), "--input", str(inp), "--output", str(out),
                           "--set", "input.id_column=n"])
        assert code == 2 and text.count("\n") == 1, text
        assert text.startswith(f"aggdec: error: output.dir: {out} {how} the input "), text
        assert str(inp) in text
    with pytest.raises(SpecError, match=f"^output.dir: {inp} is the input {inp};"):
        run_job(_spec(tiny_model_dir, inp, inp))  # the library refuses too, before any Ray work
    assert not (inp / "out").exists() and _snapshot(inp) == before
    code, text = _run(["run", "--model", str(tiny_model_dir), "--input", str(inp / "part-00001.parquet"),
                       "--output", str(tmp_path / "link"), "--set", "input.id_column=n"])
    assert code == 2 and f"{tmp_path / 'link'} contains the input {inp / 'part-00001.parquet'}" in text, text
    # a job fed its own earlier output through a glob, and object stores by prefix
    for pattern, out, message in ((f"{inp}/*.parquet", inp, f"{inp} contains the input {inp}/part-00000.parquet;"),
                                  (f"{inp}/**.parquet", inp / "out", f"{inp}/out is inside the input {inp};")):
        spec = _spec(tiny_model_dir, pattern, out)
        with pytest.raises(SpecError, match=re.escape(f"output.dir: {message}")):
            check_output_apart(spec, inspect_inputs(spec))
    for out, refused in (("s3://bucket/in/out", True), ("s3://bucket//in/", True), ("s3://bucket/input", False),
                         ("gs://bucket/in/out", False), ("s3://other/in", False)):
        spec = load_spec(None, [f"model={tiny_model_dir}", "input.path=s3://bucket/in", f"output.dir={out}"])
        if refused:
            with pytest.raises(SpecError, match=r"^output\.dir: s3://.* the input s3://bucket/in;"):
                check_output_apart(spec, [])
        else:
            check_output_apart(spec, [])

    # the clean-up removes only what a job wrote, and never an input
    spec = _spec(tiny_model_dir, inp, tmp_path / "o")
    shards = inspect_inputs(spec)
    out = OutputDir(str(inp), inputs=input_locations(spec, shards))
    removed, strangers = out.clean({}, keep=[], writes=["other"])
    assert removed == [] and strangers == [p.name for p in sorted(inp.glob("*.parquet"))]
    with pytest.raises(SpecError, match=r"part-00000\.parquet is there and no aggdec job wrote it"):
        out.clean({}, keep=[], writes=["part-00000"])
    with pytest.raises(RuntimeError, match="an input of this job; not removed"):
        out._remove("part-00000.parquet")
    assert _snapshot(inp) == before


def test_every_help_answers_without_torch_and_decoding_loads_no_inductor(tiny_model_dir):
    script = """
import sys
from click.testing import CliRunner
from cli import main
commands = [[]]
for name, command in main.commands.items():
    commands += [[name], *([name, sub] for sub in getattr(command, "commands", {}))]
assert ["decode"] in commands and ["train", "heads"] in commands
for args in commands:
    res = CliRunner().invoke(main, [*args, "--help"])
    assert res.exit_code == 0 and ("Usage:" in res.output or "usage:" in res.output), (args, res.output)
    if args == ["decode"]:
        assert "--batch-size" in res.output and "[greedy|beam|iad" in res.output, res.output
print("help imports torch:", "torch" in sys.modules)
res = CliRunner().invoke(main, ["decode", "-m", sys.argv[1], "--method", "iad"], input="the cat runs .\\n")
assert res.exit_code == 0, res.output
print("decoding imports TorchInductor:", "torch._inductor" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["help imports torch: False", "decoding imports TorchInductor: False"]


def test_a_job_that_fails_to_start_says_so_in_one_line_and_leaves_nothing(tiny_model_dir, tmp_path):
    import shutil

    from jobs.preflight import _megabytes

    inp = write_corpus(tmp_path / "in", shards=1, rows=3)
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    out = tmp_path / "deep" / "out"
    code, text = _run(["run", "--model", str(model), "--input", str(inp), "--output", str(out),
                       "--set", "input.id_column=n"])
    assert code == 2 and text.count("\n") == 1 and text.startswith("aggdec: error: model: "), text
    assert not out.exists()
    # nothing listening at the address: one line, well within 15 s, no directory left either
    t0 = time.monotonic()
    code, text = _run(["run", "--model", str(tiny_model_dir), "--input", str(inp), "--output", str(out),
                       "--set", "input.id_column=n", "--address", "127.0.0.1:1"])
    assert time.monotonic() - t0 < 15
    lines = text.strip().splitlines()
    assert code == 2, text
    assert lines[-1].startswith("aggdec: error: --address 127.0.0.1:1: no Ray cluster answers there ("), text
    assert len(lines) == 1 and not out.exists(), text  # the address is checked first
    # SIGINT while the command is still loading: the stopped line, no traceback
    proc = subprocess.run([sys.executable, "-c", "import os, signal, cli; os.kill(os.getpid(), signal.SIGINT)"],
                          capture_output=True, text=True, cwd=REPO, timeout=120, preexec_fn=_foreground)
    assert (proc.returncode, proc.stderr) == (130, "aggdec: stopped (SIGINT)\n")
    # free space and need in figures that show which is larger
    assert _megabytes(100_000, 100_001) == ("0.100000", "0.100001")
    assert _megabytes(52_000, 148_000) == ("0.05", "0.15") and _megabytes(3e9, 1e9) == ("3000.0", "1000.0")


def test_train_ar_on_a_small_text_fits_the_vocabulary_or_names_its_size(tmp_path):
    """`aggdec train ar` on 250 pairs: by default it trains as many pieces as the text holds (fewer than
    8000) and says so; given --vocab-size 8000, it stops before training with one line naming --vocab-size
    and what the text holds, exit status 2. Every flag of its help has a text."""
    from aggdec.train.args import ar_parser

    words = "the cat dog runs sat on a mat big red".split()
    rows = [" ".join(words[(i * 7 + j) % len(words)] for j in range(6)) for i in range(250)]
    (tmp_path / "train.tsv").write_text("src\ttgt\n" + "".join(f"{r}\t{r}\n" for r in rows))
    args = [*AGGDEC, "train", "ar", "--train", "train.tsv", "--valid", "train.tsv", "--src-col", "src", "--tgt-col",
            "tgt", "--max-updates", "1", "--eval-updates", "1"]
    fits = subprocess.run([*args, "--out", "m"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert fits.returncode == 0, fits.stderr
    pieces = int(re.search(r"trained sentencepiece \S+ \(vocab (\d+)\)", fits.stdout + fits.stderr)[1])
    assert pieces < 8000 and (tmp_path / "m" / "config.json").exists()
    done = subprocess.run([*args, "--vocab-size", "8000", "--out", "m2"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last == (f"aggdec: error: --vocab-size 8000: the training text holds at most "
                                             f"{pieces} pieces; pass --vocab-size {pieces} or less, or more text"), last
    assert all(a.help for a in ar_parser()._actions)


def test_train_seqkd_that_keeps_no_pair_says_why(tiny_model_dir, tmp_path, capsys):
    """`aggdec train seqkd` whose every output is dropped exits 1 with one line counting why (here: empty
    sources); one that keeps pairs exits 0 (`seqkd.main`, what the command runs)."""
    from aggdec.train import seqkd

    (tmp_path / "blank.tsv").write_text("src\n" + " \n" * 3, encoding="utf-8")
    (tmp_path / "text.tsv").write_text("src\nShe go to school .\n", encoding="utf-8")
    threads = torch.get_num_threads()  # (seqkd sets the process's)
    for data, code in (("blank.tsv", 1), ("text.tsv", 0)):
        try:
            assert seqkd.main(["--model", str(tiny_model_dir), "--data", str(tmp_path / data), "--column", "src",
                               "--out", str(tmp_path / "kd.tsv"), "--threads", "1"]) == code
        finally:
            torch.set_num_threads(threads)
        out, err = capsys.readouterr()
        if code:
            assert err.strip().splitlines()[-1] == "aggdec: seqkd kept no pair of 3 sources: 3 empty"
    assert out.strip().splitlines()[-1].endswith(f"wrote 1 pair to {tmp_path / 'kd.tsv'}")


def test_the_example_spec_keeps_iads_defaults():
    """examples/correct.toml (the default job) and `decode_options("iad")` agree on IAD's re-alignment options."""
    from aggdec.api import decode_options

    spec, defaults = load_spec(REPO / "examples" / "correct.toml", []), decode_options("iad")
    for name in ("substitution", "nearest_match", "skip_prefix"):
        assert getattr(spec.decode, name) == getattr(defaults, name), name
