"""Corpus jobs: typed TOML specs (spec), storage on any file system (storage), input checks (inputs),
commit units (units), the work of a decode actor on a unit (work, output), the exactly-once output
protocol (commit), the manifest, and the Ray Data pipeline (pipeline, run). Depends on cluster/ and
aggdec/ only.

Also aggdec as a stage of the user's own Ray Data pipeline (stage): `from jobs import
build_processor`, imported on first use so that the other modules load without Ray."""

from __future__ import annotations

from typing import Any

__all__ = ["Processor", "build_processor"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from jobs import stage

        return getattr(stage, name)
    raise AttributeError(f"module 'jobs' has no attribute {name!r}")
