"""glibc's allocator, set for decoding on the CPU: freed memory is kept for the next call.

A decoding loop allocates the same large tensors at every call (a batch's logits, its padded
encoder states, grown caches: megabytes each). With glibc's defaults, blocks above its mmap threshold
are mapped afresh and blocks freed at the top of the heap are returned to the system, so every call
pays page faults to touch them again, several times what writing the block at memory bandwidth
costs. `keep_freed_memory` raises the mmap threshold to glibc's largest (32 MiB) and the trim
threshold to 1 GiB, so such blocks are reused from the heap (docs/design.md, "Large batches: memory,
not arithmetic"). The cost is memory: up to 1 GiB freed
heap stays with the process. Larger blocks are still mapped; the verifier's top-1 keeps its logits
under that size (aggdec.thresholds.TOP1_ROWS).
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**30

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set the thresholds above for this process, once; True where it took effect (glibc), False
    elsewhere (musl, macOS, Windows), where nothing changes."""
    global _done
    if _done is None:
        _done = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            libc = ctypes.CDLL(None)
            _done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
                libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
