"""Commit units: the (input file, row range) slices a job decodes, commits and resumes by.

A file of at most `rows_per_task` rows is one unit named after the file's stem (`part-00001` ->
`OUT/part-00001.parquet`); a larger file is cut into ranges of `rows_per_task` rows named
`<stem>.rows-<start>-<stop>` (zero-padded, so names sort in input order). Boundaries depend only on
the file and `rows_per_task`, never on the cluster, so a rerun on another cluster finds the same
units. Each unit is one task of a decode actor, which reads its own rows and writes its own output.

A unit's input identity is its file's size and footer hash and its row range, planned from the
footer, plus the content hash of its slice (CONTENT_HASH over the bytes of every row group that
holds its rows, every column), which the actor computes as it reads the unit and records; a rerun
reuses a committed unit only where the file's slice hashes the same again (`slice_content`), so
that any change of an input value is decoded again.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.inputs import Shard, file_identity
from jobs.storage import resolve

CONTENT_HASH = "sha256"
"""The hash of a unit's input bytes (hashlib name; recorded with the digest)."""
HASH_BLOCK = 1 << 20
"""Bytes read and hashed at a time."""


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


class UnreadableInput(Exception):
    """A unit's input cannot be read, or changed since the job planned it; the message names the
    file, the unit and what failed."""


@dataclass(frozen=True)
class Slice:
    """A unit's input file, open and checked: `file` for reading its rows, `content` the hash of the
    unit's slice ("<CONTENT_HASH>:<hex>"), `bytes` and `seconds` what hashing it read and took."""

    file: pq.ParquetFile
    content: str
    bytes: int
    seconds: float


@contextmanager
def open_slice(unit: Unit) -> Iterator[Slice]:
    """Open the unit's file, check that its size and footer are those the unit was planned from, and
    hash the unit's slice. Raises UnreadableInput naming the file, the unit and the OS or Arrow
    message where the file is gone or cannot be read, or has changed since it was planned."""
    fs, path = resolve(unit.path)
    try:
        with fs.open_input_file(path) as f:
            identity, meta = file_identity(f)
            planned = {k: unit.identity[k] for k in ("size", "footer_sha")}
            if dict(identity) != planned:
                raise UnreadableInput(f"{unit.path}: unit {unit.name}: the file changed since the job started "
                                      f"({_changed(dict(identity), planned)}); a rerun decodes it as it is then")
            t0 = time.perf_counter()
            digest, size = hashlib.new(CONTENT_HASH), 0
            for a, b in _group_spans(meta, unit.start, unit.stop):
                f.seek(a)
                while a < b:
                    block = f.read(min(HASH_BLOCK, b - a))
                    if not block:
                        raise OSError(f"the file ends at byte {a}, inside row group bytes {a}-{b}")
                    digest.update(block)
                    a += len(block)
                    size += len(block)
            yield Slice(pq.ParquetFile(f, metadata=meta), f"{CONTENT_HASH}:{digest.hexdigest()}", size,
                        time.perf_counter() - t0)
    except (pa.ArrowException, OSError) as e:
        raise UnreadableInput(f"{unit.path}: unit {unit.name}: cannot be read ({' '.join(str(e).split())})") from e


def slice_content(unit: Unit) -> str | None:
    """The content hash of the unit's slice as its file is now (see open_slice); None where the file
    cannot be read or no longer matches the unit's plan."""
    try:
        with open_slice(unit) as sl:
            return sl.content
    except UnreadableInput:
        return None


def _group_spans(meta: pq.FileMetaData, start: int, stop: int) -> list[tuple[int, int]]:
    """[byte start, byte end) of each row group holding rows of [start, stop): from its first column
    chunk's first page (dictionary or data) to the end of its last."""
    spans, first = [], 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        if first < stop and first + rg.num_rows > start:
            chunks = [rg.column(c) for c in range(rg.num_columns)]
            begins = [c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset
                      else c.data_page_offset for c in chunks]
            spans.append((min(begins), max(b + c.total_compressed_size for b, c in zip(begins, chunks))))
        first += rg.num_rows
    return spans


def _changed(now: dict, planned: dict) -> str:
    return ", ".join(f"{k} {planned[k]} then, {now[k]} now" for k in planned if now[k] != planned[k])
