"""Where TorchInductor keeps what aggdec compiles, and how long a process waits for another one's
compile: `prepare` (both, before a compile is set up).

What aggdec compiles at run time is TorchInductor's (a compiled slot-loop step, `compile = true`;
int8 products). Inductor (torch 2.13: `_inductor/codecache.py`, `cpp_builder.py`, `cpu_vec_isa.py`)
takes a `filelock` lock per program in its cache (`TORCHINDUCTOR_CACHE_DIR`, `locks/`) while it
builds it. Those are `flock` locks, which the operating system releases when their owner dies: a
compile killed midway (SIGKILL, an actor stopped) holds nobody up, and the next process takes the
lock over. A live owner, another process compiling the same program, is waited for up to
`torch._inductor.codecache.LOCK_TIMEOUT` (TORCHINDUCTOR_FILE_LOCK_TIMEOUT, 600 s by default), after
which the compile fails (the slot loop then decodes eagerly, int8 products run op by op).

Inductor's cache of compiled graphs is not keyed by the vector instruction set it generated code
for: a program generated for AVX-512 (16 floats a vector) and found again by a process whose ISA is
AVX2 (`ATEN_CPU_CAPABILITY=avx2`, or a cache directory shared by machines of two CPU classes) is
rebuilt from its AVX-512 source with AVX2's flags and computes garbage in its vectors' tails
(measured with torch 2.13 on an AMX Xeon: int8 products and compiled steps wrong, every test of
them failing). `cache_per_isa` gives each ISA a directory of its own.
"""

from __future__ import annotations

import logging
import os
import warnings

LOCK_TIMEOUT_S = 60
"""The longest wait for another process's lock on a program, unless TORCHINDUCTOR_FILE_LOCK_TIMEOUT is set."""
_WAIT_RECORD = "Lock %s not acquired on %s, waiting %s seconds ..."  # filelock's debug record while it polls


ISA_ORDER = ("DEFAULT", "AVX2", "AVX512")
"""ATen's CPU capabilities on x86, lowest first."""


def lowered_isa() -> str | None:
    """One line where ATEN_CPU_CAPABILITY lowers ATen's capability below this CPU's own (AVX2 on a
    CPU with AVX-512, DEFAULT on one with AVX2), else None. There a TorchInductor-compiled decoder
    step decodes wrongly (torch 2.13, measured on an AMX Xeon under `ATEN_CPU_CAPABILITY=avx2`: every
    output of a 16-slot greedy step empty, with or without ONEDNN_MAX_CPU_ISA=AVX2 and a fresh
    cache), while each CPU class at its own capability decodes right: the slot loop decodes eagerly."""
    import torch

    have = torch.backends.cpu.get_cpu_capability()
    own = "AVX512" if torch.cpu._is_avx512_supported() else "AVX2" if torch.cpu._is_avx2_supported() else "DEFAULT"
    if have in ISA_ORDER and ISA_ORDER.index(have) < ISA_ORDER.index(own):
        return f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '')} lowers ATen to {have} on a CPU with {own}"
    return None


_BASE: list[str] = []  # the cache directory as first found in this process, before `cache_per_isa`


def prepare(timeout_s: float = LOCK_TIMEOUT_S) -> None:
    """`cache_per_isa` and `bound_locks`: call where a compile is set up, before it runs."""
    cache_per_isa()
    bound_locks(timeout_s)


def cache_per_isa() -> str:
    """Point TorchInductor's cache (TORCHINDUCTOR_CACHE_DIR, or its default) at a subdirectory named
    for the vector ISA Inductor generates code for in this process (`pick_vec_isa`, which follows
    ATEN_CPU_CAPABILITY) and return it. Programs compiled before the first call stay where they are."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if not _BASE:
        _BASE.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    isa = "-".join(str(pick_vec_isa()).split()) or "novec"
    path = os.path.join(_BASE[0], f"isa-{isa}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def bound_locks(timeout_s: float = LOCK_TIMEOUT_S) -> None:
    """Lower TorchInductor's wait for a lock that another live process holds to `timeout_s` (where
    TORCHINDUCTOR_FILE_LOCK_TIMEOUT does not set it), and have the first wait on each of its lock
    files say so in one warning: which file, for how long at most. Call where a compile is set up,
    before it runs; calling again changes only the bound."""
    import torch._inductor.codecache as codecache
    import torch._inductor.config as config

    if "TORCHINDUCTOR_FILE_LOCK_TIMEOUT" not in os.environ:
        # the modules that lock read codecache.LOCK_TIMEOUT when they lock, codecache's own copy of the config
        codecache.LOCK_TIMEOUT = config.file_lock_timeout = timeout_s
    logger = logging.getLogger("filelock")
    if not any(isinstance(f, _SayWaits) for f in logger.filters):
        logger.addFilter(_SayWaits(logger.getEffectiveLevel(), codecache.get_lock_dir()))
        logger.setLevel(logging.DEBUG)  # its records while it polls reach the filter, which drops them


class _SayWaits(logging.Filter):
    """On the `filelock` logger, enabled for its debug records: turns the first "not acquired" record
    of each lock file in `lock_dir` into a warning and passes on only the records the logger's
    former `level` let through."""

    def __init__(self, level: int, lock_dir: str):
        super().__init__()
        self.level, self.lock_dir, self.said = level, os.path.realpath(lock_dir), set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _WAIT_RECORD and len(record.args) == 3:
            path = os.path.realpath(str(record.args[1]))
            if os.path.dirname(path) == self.lock_dir and path not in self.said:
                self.said.add(path)
                from torch._inductor.codecache import LOCK_TIMEOUT

                warnings.warn(f"aggdec: waiting (at most {LOCK_TIMEOUT:g} s) for {path}: another process is "
                              "compiling the same TorchInductor program", stacklevel=2)
        return record.levelno >= self.level
