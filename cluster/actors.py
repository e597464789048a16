"""The decode actor: a Ray Data callable class that loads the verifier once and runs a job's task.

The task (for corpus jobs, jobs.work.UnitTask) is any picklable callable
`task(translator, options, batch) -> pyarrow.Table`: it gets the actor's loaded Translator, the
decoding options and one Ray Data batch, and returns what the driver should see. The actor holds
the model; the job decides what a batch means (here: commit units, read and written by the task).

The Ray Data stage (jobs.stage) runs jobs.stage.RowsTask instead, whose batches are the rows to
decode. `map_decode` maps a Dataset through a pool of these actors, for both.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch

from aggdec.api import DecodeOptions, Translator

if TYPE_CHECKING:
    from ray.data import Dataset

    from cluster.resources import ActorPlan


class DecodeWorker:
    """One per actor. `__init__` loads the model once; `__call__` runs `task` on a batch."""

    def __init__(self, model_dir: str, options: DecodeOptions, task: Callable[[Translator, DecodeOptions, Any], pa.Table],
                 *, device: str = "cpu", torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        self.translator = Translator.load(model_dir, device=device)
        self.options = options
        self.task = task

    def __call__(self, batch: Any) -> pa.Table:
        return self.task(self.translator, self.options, batch)


def map_decode(ds: Dataset, model_dir: str, options: DecodeOptions,
               task: Callable[[Translator, DecodeOptions, Any], pa.Table], plan: ActorPlan, *, batch_size: int,
               batch_format: str) -> Dataset:
    """`ds` mapped through `task` on a fixed pool of DecodeWorkers shaped by `plan`, batches of
    `batch_size` rows in `batch_format` ("numpy" gives a dict of arrays, "pyarrow" a Table)."""
    with warnings.catch_warnings():
        # max_restarts/max_task_retries have no named map_batches parameter in Ray 2.60; passing
        # them as extra remote args is the supported way there (deprecated from 2.64 on).
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        return ds.map_batches(
            DecodeWorker,
            fn_constructor_kwargs=dict(model_dir=model_dir, options=options, task=task, device=plan.device,
                                       torch_threads=plan.torch_threads),
            batch_size=batch_size,
            batch_format=batch_format,
            **plan.map_batches_kwargs(),
        )
