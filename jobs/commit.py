"""The output directory and its exactly-once protocol.

Layout of output.dir:
    <stem>.parquet        one per input shard, written only by `commit`
    <stem>.tsv            distill jobs: the shard's training pairs (aggdec.distill), written before the marker
    _SUCCESS.<stem>       JSON marker, written after the shard file is durable (its presence = committed)
    _manifest.json        job summary, rewritten after every commit
    .<name>.tmp           in-flight writes; stale ones are deleted when a run starts

`commit` writes `.<stem>.parquet.tmp`, fsyncs it, os.replace()s it to `<stem>.parquet`, fsyncs the
directory, then writes the marker the same way. A crash at any point leaves either no marker (the
shard is redone: its partial output is deleted) or a complete shard plus marker (it is skipped).
A marker records the job fingerprint (method signature, model sha, columns); rerunning into the
same directory with a different fingerprint is refused rather than mixing outputs.
One job at a time per output directory: a starting run deletes every stale `.*.tmp` there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from aggdec.schema import MANIFEST_NAME
from jobs.spec import SpecError

MARKER_PREFIX = "_SUCCESS."


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write via `.<name>.tmp` in the same directory, fsync, os.replace, fsync the directory."""
    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


class OutputDir:
    """Shard files and markers under one directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def output_path(self, stem: str) -> Path:
        return self.root / f"{stem}.parquet"

    def marker_path(self, stem: str) -> Path:
        return self.root / f"{MARKER_PREFIX}{stem}"

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST_NAME

    def prepare(self) -> list[str]:
        """Create the directory; delete stale `.*.tmp` files left by a killed run. -> deleted names."""
        self.root.mkdir(parents=True, exist_ok=True)
        stale = sorted(p for p in self.root.glob(".*.tmp") if p.is_file())
        for p in stale:
            p.unlink()
        return [p.name for p in stale]

    def committed(self, stem: str, fingerprint: dict) -> dict | None:
        """The marker record of a committed shard, or None (then any partial output is deleted).

        A marker whose output file is missing or has another row count, or that names a TSV that
        is missing, counts as not committed.
        A marker from a job with another fingerprint raises SpecError.
        """
        marker, out = self.marker_path(stem), self.output_path(stem)
        if marker.is_file():
            try:
                record = json.loads(marker.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = None
            if record is not None and record.get("fingerprint") != fingerprint:
                raise SpecError(f"output.dir: {marker} was written by a different job: "
                                f"{_difference(record.get('fingerprint'), fingerprint)}. "
                                "Use another output.dir or delete that one")
            if (record is not None and out.is_file() and _num_rows(out) == record.get("rows")
                    and (not record.get("tsv") or self.tsv_path(stem).is_file())):
                return record
        self.discard(stem)
        return None

    def tsv_path(self, stem: str) -> Path:
        return self.root / f"{stem}.tsv"

    def discard(self, stem: str) -> None:
        """Remove a shard's marker (first), output and TSV, if present."""
        for p in (self.marker_path(stem), self.output_path(stem), self.tsv_path(stem)):
            if p.exists():
                p.unlink()

    def commit(self, stem: str, table: pa.Table, record: dict, tsv: bytes | None = None) -> None:
        """Make `table` (and `tsv`, if given) the durable output of `stem`, then write its marker `record`."""
        atomic_write(self.output_path(stem), lambda f: pq.write_table(table, f))
        if tsv is not None:
            atomic_write(self.tsv_path(stem), lambda f: f.write(tsv))
        write_json(self.marker_path(stem), record)


def _difference(old: Any, new: dict) -> str:
    """The fingerprint fields that differ, as '<field>: <old> there, <new> in this job; ...'."""
    if not isinstance(old, dict):
        return f"its fingerprint is {old!r}"
    keys = [*new, *(k for k in old if k not in new)]
    return "; ".join(f"{k}: {old.get(k, '<unset>')!r} there, {new.get(k, '<unset>')!r} in this job"
                     for k in keys if old.get(k, "<unset>") != new.get(k, "<unset>"))


def _num_rows(path: Path) -> int | None:
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError):
        return None
