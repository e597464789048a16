"""Decode-actor resources: how many actors, what each reserves, where the model runs.

With GPUs: one actor per `gpus_per_actor` (normally 1 GPU), the model on cuda, 1 CPU each.
CPU only: every actor gets a fractional CPU share so at least one CPU stays free for Ray Data's
read tasks; actors that take all CPUs deadlock Ray Data (reads never schedule,
ray-project/ray#44687). The real parallelism of a CPU actor is `torch_threads`, not its share.

CPU default (actors = 0): one single-threaded actor per core, at most AUTO_CPU_ACTORS. A
multi-threaded actor decodes slower inside the pipeline than the same code in-process
(bench/pipeline_bench.py), because every wake-up of the driver or Ray Data preempts one of its
OpenMP threads and stalls the others at the next barrier; single-threaded actors do not stall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# CPUs kept free for Ray Data's read tasks and the driver's iteration.
RESERVED_CPUS = 1.0
# actors = 0 on a CPU-only cluster: one actor per core up to this many (each holds a model copy).
AUTO_CPU_ACTORS = 8


@dataclass(frozen=True)
class ActorPlan:
    """The resolved shape of the decode actor pool."""

    actors: int
    num_cpus: float
    num_gpus: float
    device: str  # "cuda" or "cpu"
    torch_threads: int
    max_restarts: int
    max_task_retries: int

    def map_batches_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Dataset.map_batches: a fixed actor pool plus fault tolerance.

        One task in flight per actor: with two, the first actor to start queued a second block and,
        on small inputs, took every block while the other actors idled.

        max_restarts / max_task_retries go to the actor options (Ray Data 2.60 accepts them as extra
        remote args; its own default is -1/-1, i.e. unbounded, which loops forever on a row that
        kills the process every time).
        """
        from ray.data import ActorPoolStrategy

        return dict(compute=ActorPoolStrategy(size=self.actors, max_tasks_in_flight_per_actor=1),
                    num_cpus=self.num_cpus, num_gpus=self.num_gpus or None,
                    max_restarts=self.max_restarts, max_task_retries=self.max_task_retries)


def plan_actors(cluster: dict[str, float], *, actors: int = 1, gpus_per_actor: float = 0.0,
                cpus_per_actor: float | None = None, torch_threads: int | None = None,
                max_restarts: int = 3, max_task_retries: int = 3) -> ActorPlan:
    """Resolve the spec's [resources] against `cluster` (ray.cluster_resources()).

    Raises ValueError naming the `resources.*` field when the cluster cannot hold the pool (Ray
    would otherwise wait forever for resources that never come).
    """
    cpus, gpus = float(cluster.get("CPU", 0.0)), float(cluster.get("GPU", 0.0))
    if gpus_per_actor > 0:
        if gpus < gpus_per_actor:
            raise ValueError(f"resources.gpus_per_actor: {gpus_per_actor} GPU(s) per actor, but the cluster has "
                             f"{gpus:g} GPUs; set resources.gpus_per_actor = 0 to decode on CPU")
        n = actors or max(1, int(gpus // gpus_per_actor))
        if n * gpus_per_actor > gpus:
            raise ValueError(f"resources.actors: {n} actors x {gpus_per_actor} GPUs exceed the cluster's {gpus:g} GPUs")
        share = cpus_per_actor if cpus_per_actor is not None else min(1.0, max(cpus - RESERVED_CPUS, 0.5) / n)
        device = "cuda"
    else:
        n = actors or max(1, min(int(cpus), AUTO_CPU_ACTORS))
        if cpus_per_actor is not None:
            share = cpus_per_actor
        elif cpus > 2 * RESERVED_CPUS:
            share = min(1.0, (cpus - RESERVED_CPUS) / n)
        else:  # a laptop or CI box: small fractional shares
            share = 0.5 / n
        device = "cpu"
    if n * share > max(cpus - RESERVED_CPUS, 0.0) + 1e-9 and cpus > 0:
        raise ValueError(f"resources.cpus_per_actor: {n} actors x {share:g} CPUs leave less than {RESERVED_CPUS:g} of the "
                         f"cluster's {cpus:g} CPUs for reads; Ray Data would deadlock (ray-project/ray#44687)")
    # The reserved CPU is a logical reservation that lets Ray Data schedule its (light) read tasks;
    # the decode actors still compute on every core, so threads split all CPUs between actors.
    threads = torch_threads or max(1, math.floor(max(cpus, 1.0) / n))
    if device == "cuda":
        threads = torch_threads or max(1, math.floor(share))
    return ActorPlan(actors=n, num_cpus=round(share, 4), num_gpus=gpus_per_actor, device=device,
                     torch_threads=threads, max_restarts=max_restarts, max_task_retries=max_task_retries)
