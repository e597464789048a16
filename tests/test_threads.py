"""The thread governor: one decoding thread while other processes hold the cores, the process's own
count again once they are free; decoding outputs unchanged by it."""

import dataclasses
import os
import subprocess
import sys
import time

import torch
from tiny_models import tiny_model

from aggdec import threads
from aggdec.decoding.metadata import Request
from aggdec.decoding.slot_loop import SlotLoop
from aggdec.threads import ThreadGovernor

BUSY = "while True: pass"


def _work(governor: ThreadGovernor, seconds: float) -> list[int]:
    """Parallel regions (products of 256 x 256 matrices) for `seconds`, a tick after each, as a decoding
    loop does; the thread counts seen."""
    a = torch.randn(256, 256)
    seen = []
    governor.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a
        governor.tick()
        seen.append(torch.get_num_threads())
    return seen


def test_one_thread_while_other_processes_hold_the_cores_and_the_own_count_after(monkeypatch):
    """Beside twice as many busy processes as cores the governor goes to one thread; once they are gone
    returns and stays (thresholds raised to 1 for that part: whatever else this machine runs, every
    window counts as free)."""
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    governor = ThreadGovernor()
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2 * cores)]
    try:
        busy = _work(governor, 3.0)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    monkeypatch.setattr(threads, "FREE_WAIT", 1.0)
    monkeypatch.setattr(threads, "BUSY_WAIT", 1.0)
    try:
        free = _work(governor, 2.0)
        assert busy[0] == 2 and busy[-1] == 1  # the busy cores were noticed
        assert free[-1] == 2 and governor.wanted == 2  # and their return
    finally:
        torch.set_num_threads(before)


def test_a_count_the_process_sets_is_its_own_and_one_thread_is_left_alone():
    before = torch.get_num_threads()
    governor = ThreadGovernor()
    try:
        torch.set_num_threads(1)
        assert set(_work(governor, 0.6)) == {1} and governor.wanted == 1 and governor.switches == 0
        torch.set_num_threads(2)
        governor.start()
        assert governor.wanted == 2
    finally:
        torch.set_num_threads(before)


def test_decoding_while_the_thread_count_changes_gives_the_same_outputs():
    """Greedy on a tiny model, repeated for 3 s beside busy processes (the governor then decodes on one
    thread), gives the outputs of a run at two threads."""
    model = tiny_model("postnorm-sinusoidal-shared", vocab=12)
    reqs = [Request(index=i, src=[3 + (i * 7 + j) % 9 for j in range(5 + i % 6)] + [model.cfg.eos], max_len=20)
            for i in range(24)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    two = {h.index: h.tokens for h in SlotLoop(model, max_batch_size=5).run(reqs)}
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2 * len(os.sched_getaffinity(0)))]
    try:
        end = time.perf_counter() + 3.0
        while time.perf_counter() < end:
            again = [dataclasses.replace(r, index=k * len(reqs) + r.index) for k in range(4) for r in reqs]
            busy = {h.index: h.tokens for h in SlotLoop(model, max_batch_size=5).run(again)}
            assert busy == {k * len(reqs) + i: tokens for k in range(4) for i, tokens in two.items()}
        assert threads.THREADS.chosen == 1 and threads.THREADS.wanted == 2
    finally:
        for p in procs:
            p.kill()
            p.wait()
        torch.set_num_threads(before)


def test_the_process_own_spinning_threads_are_not_other_processes():
    """A thread of this process that keeps running (as an OpenMP worker spins after a parallel region) is
    not counted as another process's: a call right after a torch operator does not take the cores as busy.
    A process that spins is counted."""
    import threading

    def reads(count) -> list[int]:
        return [count() for _ in range(3)]

    stop = threading.Event()
    a = torch.randn(512, 512)

    def spin():  # products outside the GIL: a thread of ours that keeps running
        while not stop.is_set():
            a @ a

    spinner = threading.Thread(target=spin)
    before = reads(threads.others_running)
    spinner.start()
    try:
        during = reads(threads.others_running)
    finally:
        stop.set()
        spinner.join()
    assert min(during) <= max(before)
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(0.3)
        assert max(reads(threads.others_running)) >= 1
    finally:
        proc.kill()
        proc.wait()
