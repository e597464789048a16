"""Decoding streams: on a CPU, one call's requests decoded by several loops at once, one thread each.

torch parallelizes each operator of a decoder step over `torch.get_num_threads()` threads that meet
at a barrier when it ends: a step is hundreds of short parallel regions, and each barrier waits for
the slowest thread, a long wait whenever the kernel gave its core to another process
(aggdec.threads). Where a call starts on busy cores (`THREADS.cores_busy()`) and its batch is wide
enough, the eager CPU path instead splits its requests into `n` streams, each a loop of its own
over `max_batch_size // n` rows, run by `n` Python threads while torch computes every operator on
the thread that calls it (intra-op threads set to 1 for the call, restored after): the streams
meet nowhere, and the operators, which release the GIL, run side by side. Requests are dealt to the
streams round-robin in order of source length, so each gets a like share of long and short ones.
Each stream's loop has its own drafter and draft budget. On cores of its own one loop on every
thread measured about as fast (gec-base greedy, interleaved in one process: streams 0.8x at batch
32, 0.92x at 64, 1.07x at 128), so streams are for busy machines. Outputs are the method's own: a
lossless method's output is greedy's at any batch composition, and so in any stream.
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
    """Decode `requests` with one stream per entry of `loops` (each a loop's `run`), each stream on its
    own thread with torch's intra-op threads at 1; the hypotheses of all streams."""
    n = len(loops)
    by_length = sorted(requests, key=lambda r: len(r.src))
    parts = [by_length[k::n] for k in range(n)]
    with THREADS.one_thread(), ThreadPoolExecutor(n, thread_name_prefix="aggdec-stream") as pool:
        done = list(pool.map(lambda run, part: list(run(part)), loops, parts))
    return [h for hyps in done for h in hyps]
