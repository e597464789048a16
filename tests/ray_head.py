"""A Ray head for tests, with a dashboard (the Jobs API), that stops only what it started.

Ray's own command for stopping a cluster stops every Ray on the machine (other tests', other
users'); `ray_head` runs `ray start --head --block` in a session of its own, on free ports and in a
temporary directory of its own, and at the end kills that session's processes and their descendants (SIGKILL: a SIGTERM
has the head drain for 30 s first).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PORTS = ("port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
         "metrics-export-port", "ray-client-server-port", "node-manager-port", "object-manager-port")
"""The ports of `ray start` given free ones (some default to fixed ports that another Ray may hold)."""


@dataclass(frozen=True)
class Head:
    gcs: str  # HOST:PORT, for ray.init / aggdec run --address
    dashboard: str  # http://HOST:PORT, for the Jobs API
    temp_dir: Path
    pid: int  # of `ray start`, the leader of the session every process of the head is in


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ray_head(env: dict[str, str], num_cpus: int = 2, start_timeout_s: float = 120) -> Iterator[Head]:
    """A head started with `env` (its PATH is that of the cluster's processes), up once its Jobs API
    answers and it lists its node; stopped, with everything it started, on exit."""
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_nodes

    ports = {name: free_port() for name in PORTS}
    temp = Path(tempfile.mkdtemp(prefix="rayh", dir="/tmp"))  # short: Ray's socket paths are under it
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--temp-dir={temp}",
               f"--num-cpus={num_cpus}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
               "--node-ip-address=127.0.0.1", "--disable-usage-stats", *(f"--{k}={v}" for k, v in ports.items())]
    with open(temp / "start.log", "w") as log:
        head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    dashboard = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                JobSubmissionClient(dashboard).list_jobs()
                if list_nodes(address=dashboard, timeout=5):  # the head node registered too
                    break
            except Exception:  # noqa: BLE001 - not up yet
                if head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Ray head did not start: {(temp / 'start.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield Head(gcs=f"127.0.0.1:{ports['port']}", dashboard=dashboard, temp_dir=temp, pid=head.pid)
    finally:
        _kill_tree(head.pid)
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def signal_all(head: Head, signum: int) -> None:
    """Send `signum` to every process of `head` (`tree`): SIGSTOP makes it a head that accepts
    connections and answers nothing, as a swapping one does; SIGCONT undoes it."""
    for pid in tree(head.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def tree(root: int) -> set[int]:
    """The live processes in `root`'s session and every descendant of those."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()  # after "pid (name) ": state ppid pgrp session
                parents[int(entry)] = (int(fields[1]), int(fields[3]), fields[0])
            except (OSError, ValueError):
                continue
    found = {pid for pid, (_, session, state) in parents.items() if session == root and state != "Z"}
    grown = True
    while grown:
        more = {pid for pid, (ppid, _, state) in parents.items() if ppid in found and state != "Z"} - found
        found |= more
        grown = bool(more)
    return found


def _kill_tree(root: int) -> None:
    """SIGKILL every process of `tree(root)`, until none is left."""
    for _ in range(20):
        doomed = tree(root)
        if not doomed:
            return
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
