"""Decode-actor resources: how many actors, what each reserves, where the model runs.

Planned against the cluster's alive nodes one by one, so that every actor fits on some node (a
reservation split across nodes would never schedule): an actor needs `num_cpus` (and `num_gpus`) on
one node. The job's tasks are the actors' own (each reads and writes its unit, jobs.work); there are
no other tasks to leave CPUs for.

GPUs unless told otherwise: with `gpus_per_actor` unset, a cluster with GPUs gets one actor per
GPU (1 GPU and 1 CPU each, the model on cuda), a cluster without CPU actors; `gpus_per_actor = 0`
keeps CPU actors. CPU actors: by default one single-threaded actor per CPU. A multi-threaded actor decodes slower inside
the pipeline than in-process (every wake-up of Ray or the driver preempts one of its OpenMP threads
and stalls the others at the next barrier), so `torch_threads` > 1 is for large batches on big nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


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

    def describe(self) -> str:
        """'<n> actor(s) on <device> (<resources> each)', as the job's plan line shows it."""
        each = f"{self.num_gpus:g} GPU, " if self.num_gpus else ""
        threads = f", {self.torch_threads} thread(s)" if self.device == "cpu" else ""
        return f"{self.actors} actor(s) on {self.device} ({each}{self.num_cpus:g} CPU{threads} each)"

    def map_batches_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Dataset.map_batches: a fixed actor pool plus fault tolerance.

        One task in flight per actor: with two, the first actor to start queued a second unit and, on
        small inputs, took every unit while the other actors idled. max_restarts / max_task_retries
        go to the actor options (Ray Data's own default is unbounded, which loops forever on a row
        that kills the process every time; the job's default is 0, and the driver reruns lost units).
        """
        from ray.data import ActorPoolStrategy

        return dict(compute=ActorPoolStrategy(size=self.actors, max_tasks_in_flight_per_actor=1),
                    num_cpus=self.num_cpus, num_gpus=self.num_gpus or None,
                    max_restarts=self.max_restarts, max_task_retries=self.max_task_retries)


def plan_actors(nodes: list[dict[str, float]], *, actors: int = 0, gpus_per_actor: float | None = None,
                cpus_per_actor: float | None = None, torch_threads: int | None = None,
                max_restarts: int = 0, max_task_retries: int = 0) -> ActorPlan:
    """Resolve the spec's [resources] against the alive nodes' resources ({"CPU": n, "GPU": m} each).
    `gpus_per_actor` None: 1 where the nodes have GPUs, else 0 (CPU actors).

    Raises ValueError naming the `resources.*` field when the nodes cannot hold the pool (Ray
    would otherwise wait forever for resources that never come).
    """
    threads = torch_threads or 1
    total_gpus = sum(n.get("GPU", 0.0) for n in nodes)
    if gpus_per_actor is None:
        gpus_per_actor = 1.0 if total_gpus >= 1 else 0.0
    gpu = gpus_per_actor > 0
    num_cpus = cpus_per_actor if cpus_per_actor is not None else (1.0 if gpu else float(threads))
    capacity = 0
    for node in nodes:
        fit = math.floor(node.get("CPU", 0.0) / num_cpus + 1e-9) if num_cpus > 0 else 1 << 30
        if gpu:
            fit = min(fit, math.floor(node.get("GPU", 0.0) / gpus_per_actor + 1e-9))
        capacity += max(fit, 0)
    if gpu and total_gpus < gpus_per_actor:
        raise ValueError(f"resources.gpus_per_actor: {gpus_per_actor} GPU(s) per actor, but the cluster has "
                         f"{total_gpus:g} GPUs; set resources.gpus_per_actor = 0 to decode on CPU")
    if capacity == 0:
        largest = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
        raise ValueError(f"resources.cpus_per_actor: an actor needs {num_cpus:g} CPUs on one node, the largest node "
                         f"has {largest:g}")
    n = actors or capacity
    if n > capacity:
        raise ValueError(f"resources.actors: {n} actors do not fit: the nodes hold {capacity} actors of "
                         f"{num_cpus:g} CPUs{f' and {gpus_per_actor:g} GPUs' if gpu else ''} each")
    return ActorPlan(actors=n, num_cpus=num_cpus, num_gpus=gpus_per_actor, device="cuda" if gpu else "cpu",
                     torch_threads=threads, max_restarts=max_restarts, max_task_retries=max_task_retries)
