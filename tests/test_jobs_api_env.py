"""The Jobs API against a Ray head started here, from the environment the user is in: a job
submitted to a cluster on this machine runs with the submitting interpreter, whatever python the
cluster's PATH finds first; status, logs and stop of it from the command line."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the Jobs API needs ray[default]")

from ray_head import ray_head  # noqa: E402
from test_jobs import read_outputs, write_corpus  # noqa: E402

from cluster import jobs_api  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def test_a_job_submitted_from_an_interpreter_off_the_path_runs_with_it(tiny_model_dir, tmp_path):
    """`aggdec submit` run by this interpreter, whose bin directory is on no PATH, to a head on this
    machine whose PATH finds first a python without aggdec's dependencies (a bare venv): the job runs
    `python -m cli` with this interpreter (`jobs_api.local`: the head reports an IP of this machine)
    and succeeds, with the CPU kernel of the aggdec installed for it (the uploaded checkout has
    none), and the command says nothing about the cluster's python; `status`, `logs` and `stop`
    report on it, and a submission without an output names --output."""
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # a real python, without click, pyarrow, torch
    path = os.pathsep.join([str(bare / "bin"), "/usr/bin", "/bin"])
    assert str(Path(sys.executable).parent) not in path.split(os.pathsep)
    env = {**os.environ, "PATH": path, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    inp = write_corpus(tmp_path / "in", shards=2, rows=5, seed=12)
    out = tmp_path / "out"
    with ray_head(env) as head:
        submitted = subprocess.run(
            [sys.executable, "-m", "cli", "submit", "examples/correct.toml", "--address", head.dashboard,
             "--output", str(out), "--input", str(inp), "--model", str(tiny_model_dir), "--method", "greedy",
             "--set", "input.id_column=none"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert submitted.returncode == 0, submitted.stderr
        assert "note:" not in submitted.stderr
        job_id = submitted.stdout.strip().splitlines()[0]
        deadline = time.monotonic() + 240
        while (info := jobs_api.info(head.dashboard, job_id))["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
            assert time.monotonic() < deadline, jobs_api.logs(head.dashboard, job_id)
            time.sleep(1)
        logs = jobs_api.logs(head.dashboard, job_id)
        said = "".join(f.read_text(errors="replace") for f in head.temp_dir.glob("session_*/logs/*") if f.is_file())
        cli = {name: subprocess.run([sys.executable, "-m", "cli", *args], env=env, cwd=REPO, capture_output=True,
                                    text=True, timeout=120)
               for name, args in (("status", ["status", job_id, "--address", head.dashboard]),
                                  ("logs", ["logs", job_id, "--address", head.dashboard]),
                                  ("stop", ["stop", job_id, "--address", head.dashboard]),
                                  ("no output", ["submit", "examples/correct.toml", "--address", head.dashboard]))}
    assert json.loads(cli["status"].stdout)["status"] == "SUCCEEDED"
    assert "10 rows (10 ok" in cli["logs"].stdout
    assert cli["stop"].returncode == 0 and "not running" in cli["stop"].stdout
    assert cli["no output"].returncode == 2 and "--output" in cli["no output"].stderr
    assert info["status"] == "SUCCEEDED", logs
    assert info["entrypoint"].startswith(f"{shlex.quote(sys.executable)} -m cli run examples/correct.toml")
    assert "10 rows (10 ok" in logs
    assert read_outputs(out).num_rows == 10
    # the job's code is the checkout uploaded without its built kernel; its processes load the installed one's
    assert "decode-attention kernel is not available" not in logs + said


def test_which_hosts_are_this_machine():
    """Loopback addresses and names, this machine's name and its own addresses are this machine; an
    address of no interface here, or a name that does not resolve, is not (and no cluster there is local)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("198.51.100.1", 9))  # no packet is sent: only the interface that route would take
        own = s.getsockname()[0]
    for host in ("127.0.0.1", "localhost", "127.0.0.2", "::1", socket.gethostname(), own):
        assert jobs_api.this_machine(host), host
    for host in ("198.51.100.1", "203.0.113.7", "no-such-host.invalid"):
        assert not jobs_api.this_machine(host), host
        assert jobs_api.job_python(f"http://{host}:8265") == "python"
