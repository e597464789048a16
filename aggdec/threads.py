"""Decoding threads that follow how busy the cores are.

torch runs each operator of a decoder step as a parallel region of `torch.get_num_threads()` OpenMP
threads that meet at a barrier when it ends. On a machine whose cores other processes share, a
thread of ours that the kernel has descheduled holds the others at that barrier; a decoder that runs
hundreds of regions a second then gets far less done than its share of the CPU would allow (the
contention benchmark, docs/benchmarks.md). One thread has no barriers to wait at.

`THREADS` reads, over windows of `WINDOW_S` seconds of decoding, how long the decoding thread was
ready to run but waited for a core (the kernel's run-queue time, `/proc/thread-self/schedstat`).
Where it waited more than `BUSY_WAIT` of the window, other threads want the cores and it decodes on
one thread; it goes back to the count the process set (`torch.set_num_threads`) once a window shows
at most `FREE_WAIT`, and waits twice as long before the next return each time a return finds the
cores still busy. On a machine of its own its thread never waits and nothing changes; where the
kernel does not report run-queue time it does nothing. Where a call starts on busy cores
(`cores_busy`), the eager CPU path decodes it in streams of one thread each instead
(aggdec.decoding.streams), which take one thread's share of the cores each. Outputs depend on the thread count only as
far as the model's own arithmetic does (as for two greedy runs at different counts).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

WINDOW_S = 0.25
"""Seconds of decoding a measurement covers."""
BUSY_WAIT = 0.2
"""Share of a window spent waiting for a core over which the cores are taken to be busy."""
FREE_WAIT = 0.05
"""Share of a window spent waiting for a core under which one thread takes them to be free again."""
LONGEST_WAIT_S = 8.0
"""The longest wait before trying the process's thread count again."""
SCHEDSTAT = "/proc/thread-self/schedstat"
PROBES = 3
"""Reads of the machine's runnable threads (`/proc/stat`'s procs_running) a `cores_busy` takes, 1 ms
apart; the fewest counts (a thread that ran for a moment is no load)."""


def run_queue_seconds() -> float | None:
    """Seconds the calling thread has waited for a core so far; None where the kernel does not say."""
    try:
        with open(SCHEDSTAT) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _own_running() -> int:
    """This process's threads that are runnable now, the calling one included (`/proc/self/task`): an
    OpenMP worker of ours spins runnable for a while after each parallel region."""
    running = 0
    for task in os.scandir("/proc/self/task"):
        try:
            with open(f"{task.path}/stat") as f:
                running += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return running


def others_running() -> int | None:
    """Runnable threads of other processes on the machine (the fewest of PROBES reads; not this process's
    own, whose OpenMP workers spin for a while after a torch operator); None where the kernel does not
    say."""
    counts = []
    for k in range(PROBES):
        if k:
            time.sleep(0.001)
        try:
            with open("/proc/stat") as f:
                running = [int(line.split()[1]) for line in f if line.startswith("procs_running")]
            counts.extend(max(0, n - _own_running()) for n in running)
        except (OSError, ValueError, IndexError):
            return None
    return min(counts) if counts else None


class ThreadGovernor:
    """One per process (`THREADS`): decoding loops call `start()` when a run starts and `tick()` once
    per verifier call, on the thread that decodes. Between runs nothing is measured."""

    def __init__(self) -> None:
        self.wanted = 0  # the process's own thread count
        self.chosen = 0  # the count set here last
        self.switches = 0  # changes of the thread count so far
        self._backoff = WINDOW_S  # seconds on one thread before the wanted count is tried again
        self._since = 0.0  # when the thread count last changed
        self._wall = 0.0
        self._waited: float | None = None
        self._one_thread = False  # decoding streams run: every loop on one thread, nothing to govern

    def own_threads(self) -> int:
        """The process's own thread count: torch's, or where that is this governor's choice, the count
        it replaced."""
        threads = torch.get_num_threads()
        return self.wanted if threads == self.chosen and self.wanted else threads

    def cores_busy(self) -> bool:
        """Whether other threads hold cores the process's own threads would need: the last window of a
        run found them busy (one thread runs), or more threads want to run now than the process's
        cores leave free."""
        if self.chosen < self.wanted:
            return True
        others = others_running()
        return others is not None and others + self.own_threads() > len(os.sched_getaffinity(0))

    @contextmanager
    def one_thread(self) -> Iterator[None]:
        """torch's intra-op threads at 1 for the block (decoding streams, aggdec.decoding.streams), and
        the count it had after; loops that start meanwhile are not governed."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self._one_thread = True
        try:
            yield
        finally:
            self._one_thread = False
            torch.set_num_threads(threads)

    def start(self) -> None:
        """A run starts: measure from here."""
        if self._one_thread:
            return
        threads = torch.get_num_threads()
        if threads != self.chosen:  # set by the process itself: its count
            self.wanted = self.chosen = threads
            self._backoff = WINDOW_S
        self._wall, self._waited = time.perf_counter(), run_queue_seconds()

    def tick(self) -> None:
        """After a verifier call: at the end of a window, the thread count for the next one."""
        wall = time.perf_counter()
        elapsed = wall - self._wall
        if elapsed < WINDOW_S or self._waited is None or self.wanted < 2 or self._one_thread:
            return
        waited = run_queue_seconds()
        share = (waited - self._waited) / elapsed
        if self.chosen > 1 and share > BUSY_WAIT:
            if wall - self._since < 2 * WINDOW_S:  # a return that found the cores still busy
                self._backoff = min(2 * self._backoff, LONGEST_WAIT_S)
            self._set(1, wall)
        elif self.chosen < self.wanted and share < FREE_WAIT and wall - self._since >= self._backoff:
            self._set(self.wanted, wall)
        self._wall, self._waited = wall, waited

    def _set(self, threads: int, now: float) -> None:
        torch.set_num_threads(threads)
        self.chosen, self._since = threads, now
        self.switches += 1


THREADS = ThreadGovernor()
"""The process's governor (torch's thread count is the process's)."""
