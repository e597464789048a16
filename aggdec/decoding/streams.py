"""Decoding streams: on busy CPU cores, one call's requests decoded by several loops at once, each on a
Python thread of its own with torch's intra-op threads at 1, so that they meet at no barrier (docs/design.md,
"Threads on a shared machine").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from aggdec.decoding.metadata import Hypothesis, Request
from aggdec.threads import THREADS
from aggdec.thresholds import MIN_STREAM_BATCH

def stream_count(threads: int, max_batch_size: int, requests: int) -> int:
    """Streams for a call: one per thread of the process's own count (`THREADS.own_threads()`), while
    each stream gets MIN_STREAM_BATCH rows and requests."""
    return max(1, min(threads, max_batch_size // MIN_STREAM_BATCH, requests // MIN_STREAM_BATCH))


def decode_in_streams(loops: list[Callable[[list[Request]], Iterable[Hypothesis]]],
                      requests: list[Request]) -> list[Hypothesis]:
    """The hypotheses of `requests` decoded with one stream per entry of `loops` (each a loop's `run`),
    dealt round-robin in order of source length (each stream gets a like share of long and short ones)."""
    n = len(loops)
    by_length = sorted(requests, key=lambda r: len(r.src))
    parts = [by_length[k::n] for k in range(n)]
    with THREADS.one_thread(), ThreadPoolExecutor(n, thread_name_prefix="aggdec-stream") as pool:
        done = list(pool.map(lambda run, part: list(run(part)), loops, parts))
    return [h for hyps in done for h in hyps]
