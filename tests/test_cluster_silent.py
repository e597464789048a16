"""Cluster commands against an address that accepts connections and never answers (a stuck proxy, a
port-forward whose far end is gone, a swapping head): each ends within 15 s with one line naming the
address, what went unanswered and what to check, and a non-zero exit; `logs --follow` ends so too
when the head goes silent mid-stream."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BOUND_S = 15.0


@pytest.fixture(scope="module")
def silent():
    """HOST:PORT of a real listener on 127.0.0.1 that accepts every connection and never writes a byte."""
    server = socket.create_server(("127.0.0.1", 0), backlog=64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed at the end
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in held:
        conn.close()


COMMANDS = {
    "submit": ["submit", "examples/correct.toml", "--output", "s3://b/o", "--address", "http://{silent}"],
    "status": ["status", "raysubmit_x", "--address", "http://{silent}"],
    "logs": ["logs", "raysubmit_x", "--address", "http://{silent}"],
    "logs --follow": ["logs", "raysubmit_x", "--follow", "--address", "http://{silent}"],
    "stop": ["stop", "raysubmit_x", "--address", "http://{silent}"],
    "status, a GCS address": ["status", "raysubmit_x", "--address", "{silent}"],
    "run --address": ["run", "examples/correct.toml", "--output", "{out}", "--address", "{silent}"],
}


def _env() -> dict[str, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_API_SERVER_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def against_silent(silent, tmp_path_factory):
    """Every command of COMMANDS started at once against `silent`, each in its own process and thread:
    {name: (thread, result)}, result filled with (the address given, the finished process, seconds)."""
    out = tmp_path_factory.mktemp("silent") / "out"
    runs = {}
    for name, args in COMMANDS.items():
        args = [a.format(silent=silent, out=out) for a in args]
        result: dict = {"address": args[args.index("--address") + 1], "out": out}

        def run(args=args, result=result) -> None:
            start = time.monotonic()
            result["done"] = subprocess.run([sys.executable, "-m", "cli", *args], env=_env(), cwd=REPO,
                                            capture_output=True, text=True, timeout=60)
            result["took"] = time.monotonic() - start

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        runs[name] = (thread, result)
    return runs


@pytest.mark.xdist_group("silent")
@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_silent_address_is_one_line_within_15_s(name, against_silent):
    thread, result = against_silent[name]
    thread.join(60)
    assert not thread.is_alive(), f"{name}: still waiting after 60 s"
    done = result["done"]
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stdout + done.stderr
    assert lines[0].startswith("aggdec: error: ") and result["address"] in lines[0], lines[0]
    assert "accepts connections there but did not answer" in lines[0] and "check that the head node" in lines[0]
    assert result["took"] < BOUND_S, f"{name}: {result['took']:.1f} s"
    assert not result["out"].exists()


def test_logs_follow_ends_in_one_line_when_the_head_goes_silent_mid_stream(tmp_path):
    """A real head runs a job that prints, goes quiet for longer than `tail_logs`'s silence (its head
    still answers, so `--follow` waits on), prints again; then every process of the head is stopped
    (SIGSTOP): `aggdec logs --follow` ends with one line naming the address within 15 s of the silence."""
    pytest.importorskip("aiohttp", reason="the Jobs API needs ray[default]")
    from ray.job_submission import JobSubmissionClient
    from ray_head import ray_head, signal_all

    from cluster import jobs_api

    script = (f"import time\nprint('before the quiet', flush=True)\ntime.sleep({1.5 * jobs_api.SILENCE_S})\n"
              "for i in range(10**4):\n    print('line', i, flush=True)\n    time.sleep(0.2)\n")
    with ray_head(_env()) as head:
        job = JobSubmissionClient(head.dashboard).submit_job(entrypoint=shlex.join([sys.executable, "-c", script]))
        follow = subprocess.Popen([sys.executable, "-m", "cli", "logs", job, "--follow", "--address", head.dashboard],
                                  env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = []
        try:
            for line in follow.stdout:
                seen.append(line)
                if line.startswith("line 5"):
                    break
            assert any(line.startswith("before the quiet") for line in seen) and seen[-1].startswith("line 5"), seen
            signal_all(head, signal.SIGSTOP)
            silent_since = time.monotonic()
            _, err = follow.communicate(timeout=60)
            took = time.monotonic() - silent_since
        finally:
            follow.kill()
            signal_all(head, signal.SIGCONT)
    lines = err.splitlines()
    assert follow.returncode == 2 and len(lines) == 1, err
    assert head.dashboard in lines[0] and "did not answer a status request" in lines[0], lines[0]
    assert took < BOUND_S, f"{took:.1f} s"
