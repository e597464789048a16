"""The Ray Data pipeline of a job: commit units -> decode actors -> commit records.

The dataset is the list of pending units (one block each); `map_batches` runs them on a fixed pool
of decode actors (cluster.actors.DecodeWorker running a jobs.work.UnitTask), which read their own
input rows and write their own outputs. What flows back to the driver is one small commit record
per unit.
"""

from __future__ import annotations

import ray.data
from ray.data import Dataset

from cluster.actors import map_decode
from cluster.resources import ActorPlan
from jobs.spec import JobSpec
from jobs.units import Unit
from jobs.work import UnitTask


def build_pipeline(spec: JobSpec, plan: ActorPlan, task: UnitTask, units: list[Unit]) -> Dataset:
    """A dataset of commit records, one per unit of `units`, decoded on the actors of `plan`."""
    ds = ray.data.from_items([{"unit": u.to_json()} for u in units], override_num_blocks=len(units))
    return map_decode(ds, spec.model, spec.decode, task, plan, batch_size=1, batch_format="numpy")
