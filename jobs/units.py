"""Commit units: the (input file, row range) slices a job decodes, commits and resumes by.

A file of at most `rows_per_task` rows is one unit named after the file's stem (`part-00001` ->
`OUT/part-00001.parquet`); a larger file is cut into ranges of `rows_per_task` rows named
`<stem>.rows-<start>-<stop>` (zero-padded, so names sort in input order). Boundaries depend only on
the file and `rows_per_task`, never on the cluster, so a rerun on another cluster finds the same
units. Each unit is one task of a decode actor, which reads its own rows and writes its own output.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from jobs.inputs import Shard


@dataclass(frozen=True)
class Unit:
    """Rows [start, stop) of input file `path`. `identity`: the input slice's identity (file size,
    footer hash, row range), recorded when the unit commits."""

    path: str
    stem: str
    start: int
    stop: int
    name: str
    identity: dict

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Unit":
        return cls(**json.loads(text))


def plan_units(shards: list[Shard], rows_per_task: int) -> list[Unit]:
    """The units of `shards`, in input order (empty files are one empty unit)."""
    units = []
    for s in shards:
        ranges = [(0, s.rows)] if s.rows <= rows_per_task else [
            (a, min(a + rows_per_task, s.rows)) for a in range(0, s.rows, rows_per_task)]
        width = max(10, len(str(s.rows)))
        for a, b in ranges:
            name = s.stem if len(ranges) == 1 else f"{s.stem}.rows-{a:0{width}d}-{b:0{width}d}"
            units.append(Unit(path=s.path, stem=s.stem, start=a, stop=b, name=name,
                              identity={**dict(s.identity), "start": a, "stop": b}))
    return units
