"""How long a process waits for another one's TorchInductor compile: `bound_locks`.

What aggdec compiles at run time is TorchInductor's (a compiled slot-loop step, `compile = true`;
int8 products). Inductor (torch 2.13: `_inductor/codecache.py`, `cpp_builder.py`, `cpu_vec_isa.py`)
takes a `filelock` lock per program in its cache (`TORCHINDUCTOR_CACHE_DIR`, `locks/`) while it
builds it. Those are `flock` locks, which the operating system releases when their owner dies: a
compile killed midway (SIGKILL, an actor stopped) holds nobody up, and the next process takes the
lock over. A live owner, another process compiling the same program, is waited for up to
`torch._inductor.codecache.LOCK_TIMEOUT` (TORCHINDUCTOR_FILE_LOCK_TIMEOUT, 600 s by default), after
which the compile fails (the slot loop then decodes eagerly, int8 products run op by op).
"""

from __future__ import annotations

import logging
import os
import warnings

LOCK_TIMEOUT_S = 60
"""The longest wait for another process's lock on a program, unless TORCHINDUCTOR_FILE_LOCK_TIMEOUT is set."""
_WAIT_RECORD = "Lock %s not acquired on %s, waiting %s seconds ..."  # filelock's debug record while it polls


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
