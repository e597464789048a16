"""An address where no Ray cluster answers, or where something else does, is one line within
seconds, for `aggdec run --address` (a cluster's GCS) and for the Jobs API commands (a dashboard)."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def not_ray():
    """HOST:PORT of an HTTP server that is not Ray (what a dashboard's port looks like to `run`)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


CASES = {
    "run, nothing answers": (["run", "examples/correct.toml", "--address", "127.0.0.1:1"],
                             "no Ray cluster answers there"),
    "run, not a GCS": (["run", "examples/correct.toml", "--address", "{not_ray}"], "not a Ray cluster's GCS"),
    "run, a dashboard's address": (["run", "examples/correct.toml", "--address", "http://127.0.0.1:1"],
                                   "a dashboard's address"),
    "submit, nothing answers": (["submit", "examples/correct.toml", "--output", "s3://b/o", "--address",
                                 "http://127.0.0.1:1"], "no Ray dashboard answers there"),
    "submit, a GCS address where nothing answers": (["submit", "examples/correct.toml", "--output", "s3://b/o",
                                                     "--address", "127.0.0.1:1"], "no Ray cluster answers there"),
    "status, nothing answers": (["status", "raysubmit_x", "--address", "http://127.0.0.1:1"],
                                "no Ray dashboard answers there"),
    "status, a GCS address where nothing answers": (["status", "raysubmit_x", "--address", "127.0.0.1:1"],
                                                    "no Ray cluster answers there"),
    "status, not a dashboard": (["status", "raysubmit_x", "--address", "http://{not_ray}"], "not a Ray dashboard"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_address_without_ray_is_one_line_within_seconds(case, not_ray, tmp_path):
    """The whole output of the command (Ray's own lines included: the command runs in a process of
    its own) is one error line naming the address, exit status 2, in under 15 s."""
    args, says = CASES[case]
    args = [a.format(not_ray=not_ray) for a in args]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_API_SERVER_ADDRESS", None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cli", *args, *(["--output", str(tmp_path / "out")]
                                                                  if args[0] == "run" else [])],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stdout + done.stderr
    address = args[args.index("--address") + 1]
    assert lines[0].startswith("aggdec: error: ") and address in lines[0] and says in lines[0], lines[0]
    assert took < 15, f"{took:.1f} s"
    assert not (tmp_path / "out").exists()
