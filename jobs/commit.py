"""The output location and its exactly-once protocol, on any file system (jobs.storage).

Layout of output.dir, per commit unit (jobs.units: a whole input file, or a row range of one):
    <unit>.parquet        the unit's output rows, written once by the decode worker
    <unit>.tsv            distill jobs: the unit's training pairs (aggdec.distill), written before the marker
    _SUCCESS.<unit>       JSON commit record, written after the unit's files: its presence = committed
    _manifest.json        job summary, rewritten by the driver as units commit
    _lease.json           the running job's lease (jobs.lease): one job at a time per location
    .<name>.tmp           local file systems only: in-flight writes; stale ones are deleted when a run starts

Every file is written whole or not at all (a rename on local file systems, one PUT on object
stores), and the record only after the output, so a crash at any point leaves either no record
(the unit is redone and its output overwritten: names are deterministic) or a complete unit.
A record carries the job fingerprint (every option that can change an output, the model, the
columns) and the identity of the input slice (file size, footer hash, row range): a rerun reuses a
unit only if both match. A different fingerprint is refused rather than mixed; a changed input
file is recomputed. One job at a time per output location, enforced by the lease: a job deletes
stale tmp files and uncommitted units only once it holds it.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from aggdec.schema import MANIFEST_NAME
from jobs.spec import SpecError
from jobs.storage import Location

MARKER_PREFIX = "_SUCCESS."


class OutputDir:
    """Unit files and commit records under one location."""

    def __init__(self, location: Location | str):
        self.loc = location if isinstance(location, Location) else Location(location)

    @property
    def uri(self) -> str:
        return self.loc.uri

    def prepare(self) -> list[str]:
        """Create the location; delete stale `.*.tmp` files left by a killed run. -> deleted names."""
        self.loc.makedirs()
        stale = [n for n in self.loc.names() if n.startswith(".") and n.endswith(".tmp")]
        for name in stale:
            self.loc.delete(name)
        return stale

    def records(self) -> dict[str, dict | None]:
        """{unit: its commit record, or None where the record is unreadable} for every record present."""
        out = {}
        for name in self.loc.names():
            if name.startswith(MARKER_PREFIX):
                try:
                    out[name[len(MARKER_PREFIX):]] = json.loads(self.loc.read_bytes(name))
                except (json.JSONDecodeError, UnicodeDecodeError, OSError):
                    out[name[len(MARKER_PREFIX):]] = None
        return out

    def committed(self, unit: str, record: dict | None, fingerprint: dict, identity: dict) -> bool:
        """Whether `unit` (whose record, read by `records`, is `record`) is committed for this job and
        this input slice. A record of a job with another fingerprint raises SpecError naming what
        differs; a unit not committed (no record, an input that changed, a missing or short output)
        has its files discarded."""
        if record is not None and record.get("fingerprint") != fingerprint:
            raise SpecError(f"output.dir: {self.loc.uri_of(MARKER_PREFIX + unit)} was written by a different job: "
                            f"{_difference(record.get('fingerprint'), fingerprint)}. "
                            "Use another output.dir or delete that one")
        if (record is not None and record.get("input") == identity
                and _num_rows(self.loc, f"{unit}.parquet") == record.get("rows")
                and (not record.get("tsv") or self.loc.exists(f"{unit}.tsv"))):
            return True
        self.discard(unit)
        return False

    def discard(self, unit: str) -> None:
        """Remove a unit's record (first), output and TSV, if present."""
        for name in (MARKER_PREFIX + unit, f"{unit}.parquet", f"{unit}.tsv"):
            self.loc.delete(name)

    def commit(self, unit: str, table: pa.Table, record: dict, tsv: bytes | None = None) -> None:
        """Make `table` (and `tsv`, if given) the durable output of `unit`, then write its record."""
        self.loc.write(f"{unit}.parquet", lambda f: pq.write_table(table, f))
        if tsv is not None:
            self.loc.write_bytes(f"{unit}.tsv", tsv)
        write_json(self.loc, MARKER_PREFIX + unit, record)

    def write_manifest(self, manifest: dict) -> None:
        write_json(self.loc, MANIFEST_NAME, manifest)


def write_json(loc: Location, name: str, obj: Any) -> None:
    loc.write_bytes(name, (json.dumps(obj, indent=2) + "\n").encode("utf-8"))


def _difference(old: Any, new: dict) -> str:
    """The fingerprint fields that differ, as '<field>: <old> there, <new> in this job; ...'."""
    if not isinstance(old, dict):
        return f"its fingerprint is {old!r}"
    keys = [*new, *(k for k in old if k not in new)]
    return "; ".join(f"{k}: {old.get(k, '<unset>')!r} there, {new.get(k, '<unset>')!r} in this job"
                     for k in keys if old.get(k, "<unset>") != new.get(k, "<unset>"))


def _num_rows(loc: Location, name: str) -> int | None:
    try:
        with loc.fs.open_input_file(loc.path(name)) as f:
            return pq.ParquetFile(f).metadata.num_rows
    except (pa.ArrowException, OSError):
        return None
