"""The Ray Data pipeline of a job: commit units -> decode actors -> commit records.

The dataset is the list of pending units (one block each); `map_batches` runs them on a fixed pool
of decode actors (cluster.actors.DecodeWorker running a jobs.work.UnitTask), which read their own
input rows and write their own outputs. What flows back to the driver is one small commit record
per unit.
"""

from __future__ import annotations

import warnings

import ray.data
from ray.data import Dataset

from cluster.actors import DecodeWorker
from cluster.resources import ActorPlan
from jobs.spec import JobSpec
from jobs.units import Unit
from jobs.work import UnitTask


def build_pipeline(spec: JobSpec, plan: ActorPlan, task: UnitTask, units: list[Unit]) -> Dataset:
    """A dataset of commit records, one per unit of `units`, decoded on the actors of `plan`."""
    ds = ray.data.from_items([{"unit": u.to_json()} for u in units], override_num_blocks=len(units))
    with warnings.catch_warnings():
        # max_restarts/max_task_retries have no named map_batches parameter in Ray 2.60; passing
        # them as extra remote args is the supported way there (deprecated from 2.64 on).
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        return ds.map_batches(
            DecodeWorker,
            fn_constructor_kwargs=dict(model_dir=spec.model, options=spec.decode, task=task, device=plan.device,
                                       torch_threads=plan.torch_threads),
            batch_size=1,
            batch_format="numpy",
            **plan.map_batches_kwargs(),
        )
