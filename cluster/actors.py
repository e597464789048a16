"""The decode actor: a Ray Data callable class that loads the verifier once and runs a job's task.

The task (for corpus jobs, jobs.work.UnitTask) is any picklable callable
`task(translator, options, batch) -> pyarrow.Table`: it gets the actor's loaded Translator, the
decoding options and one Ray Data batch, and returns what the driver should see. The actor holds
the model; the job decides what a batch means (here: commit units, read and written by the task).
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
import torch

from aggdec.api import DecodeOptions, Translator


class DecodeWorker:
    """One per actor. `__init__` loads the model once; `__call__` runs `task` on a batch."""

    def __init__(self, model_dir: str, options: DecodeOptions, task: Callable[[Translator, DecodeOptions, dict], pa.Table],
                 *, device: str = "cpu", torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        self.translator = Translator.load(model_dir, device=device)
        self.options = options
        self.task = task

    def __call__(self, batch: dict) -> pa.Table:
        return self.task(self.translator, self.options, batch)
