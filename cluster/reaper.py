"""What is left of a local Ray whose driver died without shutting it down (SIGKILL, the OOM killer).

Ray's own fate-sharing ends the GCS, the raylet and the workers with the driver, but its agents (the
dashboard agent, the runtime-env agent) first try to report the raylet's death to the GCS, which is
gone, and outlive it by about a minute. `watch(session_dir)` starts this module in a process of its
own session (a signal to the driver's process group or terminal does not reach it), holding the read
end of a pipe whose write end only the driver holds. When that pipe closes (the driver disconnected,
or died), every process that still has a file open under the Ray session's directory (each of its
processes writes its logs there) is killed. Linux only (it reads /proc); elsewhere nothing is started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROUNDS = 5
"""Scans of /proc (half a second apart) until none of the session's processes is left."""


def watch(session_dir: str) -> subprocess.Popen | None:
    """Start the reaper of the local Ray whose session directory is `session_dir`; the caller keeps
    the returned process's stdin open for as long as that Ray should live, and closes it (`release`)
    after shutting Ray down. None where /proc is not there to read."""
    if not Path("/proc/self/fd").is_dir():
        return None
    root = str(Path(__file__).resolve().parent.parent)  # where the `cluster` package is importable from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "cluster.reaper", session_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def release(reaper: subprocess.Popen | None) -> None:
    """Close the pipe: the reaper kills what is left of the session (nothing, after ray.shutdown) and exits."""
    if reaper is not None and reaper.stdin:
        with contextlib.suppress(OSError):
            reaper.stdin.close()


def remains(session_dir: str, spare: set[int]) -> set[int]:
    """The processes, other than this one and `spare`, with a file open under `session_dir`."""
    prefix = str(Path(session_dir).resolve()) + os.sep
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in spare or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(prefix):
                        found.add(int(entry))
                        break
    return found


def main(session_dir: str) -> None:
    driver = os.getppid()  # still running after a release: it writes its own log there too
    sys.stdin.buffer.read()  # until the driver's end closes
    for _ in range(ROUNDS):
        left = remains(session_dir, {driver})
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)


if __name__ == "__main__":
    main(sys.argv[1])
