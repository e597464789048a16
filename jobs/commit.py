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
columns) and the identity of the input slice (file size, footer hash, row range and the hash of
the slice's bytes, jobs.units): a rerun reuses a unit only if both match. A different fingerprint
is refused rather than mixed; a changed input is recomputed. One job at a time per output
location, enforced by the lease: a job deletes stale tmp files and uncommitted units only once it
holds it.

Only files provably written by a job are ever removed: commit records and `.*.tmp` files by their
names, unit Parquet files by their footer, which names their unit (UNIT_KEY), and a unit's TSV
through its Parquet file; never a path of the job's inputs (`inputs`), whatever its name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from aggdec.schema import MANIFEST_NAME
from jobs.spec import SpecError
from jobs.storage import Location, is_hidden, location_key

MARKER_PREFIX = "_SUCCESS."
UNIT_KEY = b"aggdec.unit"
"""Key of the Parquet key-value metadata that names the unit a unit file was written for."""


class OutputDir:
    """Unit files and commit records under one location. `inputs`: location keys
    (jobs.storage.location_key) of the job's inputs, which are never removed."""

    def __init__(self, location: Location | str, *, inputs: Iterable[str] = ()):
        self.loc = location if isinstance(location, Location) else Location(location)
        self.inputs = frozenset(inputs)

    @property
    def uri(self) -> str:
        return self.loc.uri

    def prepare(self) -> list[str]:
        """Create the location; delete stale `.*.tmp` files left by a killed run. -> deleted names."""
        self.loc.makedirs()
        stale = [n for n in self.loc.names() if n.startswith(".") and n.endswith(".tmp")]
        for name in stale:
            self._remove(name)
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

    def check_job(self, records: dict[str, dict | None], fingerprint: dict) -> None:
        """Raise SpecError naming what differs where a record (as `records` reads them) was written by
        a job with another fingerprint: its outputs are refused rather than mixed or removed."""
        for unit, record in sorted(records.items()):
            if record is not None and record.get("fingerprint") != fingerprint:
                raise SpecError(f"output.dir: {self.loc.uri_of(MARKER_PREFIX + unit)} was written by a different job: "
                                f"{_difference(record.get('fingerprint'), fingerprint)}. "
                                "Use another output.dir or delete that one")

    def committed(self, unit: str, record: dict | None, identity: dict) -> bool:
        """Whether `unit` (whose record, read by `records`, is `record`) is committed for this input
        slice: a record for `identity` and a complete output. Removes nothing (see `clean`)."""
        return (record is not None and record.get("input") == identity
                and _num_rows(self.loc, f"{unit}.parquet") == record.get("rows")
                and (not record.get("tsv") or self.loc.exists(f"{unit}.tsv")))

    def clean(self, records: dict[str, dict | None], keep: Iterable[str],
              writes: Iterable[str]) -> tuple[list[str], list[str]]:
        """Remove every job output here that no unit of `keep` owns: commit records, then the TSV and
        Parquet files of units that a job wrote (an earlier cut of the inputs, a run stopped between
        a unit's output and its record). A Parquet file is a job's when a record of `records` (as
        `records` reads them, checked by `check_job`) names it as its output or its footer names its
        unit (UNIT_KEY). -> (removed names, names of Parquet files here that no job wrote, left
        alone). Raises SpecError, before removing anything, where a unit of `writes` would replace a
        file that no job wrote."""
        keep, writes, names = set(keep), set(writes), self.loc.names()
        owned = {f"{u}.parquet" for u, r in records.items()
                 if isinstance(r, dict) and r.get("output") == self.loc.uri_of(f"{u}.parquet")}
        outputs, strangers = [], []
        for name in names:
            unit = name[: -len(".parquet")]
            if name.endswith(".parquet") and unit not in keep and not is_hidden(name):
                (outputs if name in owned or self.unit_of(name) == unit else strangers).append(name)
        for name in strangers:
            if name[: -len(".parquet")] in writes:
                raise SpecError(f"output.dir: {self.loc.uri_of(name)} is there and no aggdec job wrote it; this job "
                                "would replace it: move it away or choose another output.dir")
        removed = [n for n in names if n.startswith(MARKER_PREFIX) and n[len(MARKER_PREFIX):] not in keep]
        for name in outputs:  # a TSV before its Parquet file, which proves it a job's
            tsv = f"{name[: -len('.parquet')]}.tsv"
            removed += [tsv, name] if tsv in names else [name]
        for name in removed:  # records first: a unit without its record is not committed
            self._remove(name)
        return removed, strangers

    def unit_of(self, name: str) -> str | None:
        """The unit that Parquet file `name` was written for (its footer's UNIT_KEY), None where it
        names none or is not readable Parquet."""
        try:
            with self.loc.fs.open_input_file(self.loc.path(name)) as f:
                meta = pq.ParquetFile(f).schema_arrow.metadata or {}
        except (pa.ArrowException, OSError):
            return None
        return meta[UNIT_KEY].decode("utf-8", "replace") if UNIT_KEY in meta else None

    def _remove(self, name: str) -> None:
        """Delete `name`, refusing (RuntimeError) where it is one of the job's inputs."""
        if location_key(self.loc.uri_of(name)) in self.inputs:
            raise RuntimeError(f"{self.loc.uri_of(name)}: an input of this job; not removed")
        self.loc.delete(name)

    def commit(self, unit: str, table: pa.Table, record: dict, tsv: bytes | None = None) -> None:
        """Make `table` (and `tsv`, if given) the durable output of `unit`, then write its record. The
        Parquet footer names the unit (UNIT_KEY). Raises UnwritableOutput naming the file, the unit
        and the OS message where a write fails (nothing of it is left behind)."""
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), UNIT_KEY: unit.encode("utf-8")})
        writes = [(f"{unit}.parquet", lambda f: pq.write_table(table, f))]
        if tsv is not None:
            writes.append((f"{unit}.tsv", lambda f: f.write(tsv)))
        writes.append((MARKER_PREFIX + unit, lambda f: f.write(_json_bytes(record))))
        for name, write in writes:
            self._write(name, write, f"unit {unit}: ")

    def write_manifest(self, manifest: dict) -> None:
        """Write `_manifest.json`; raises UnwritableOutput naming it and the OS message."""
        self._write(MANIFEST_NAME, lambda f: f.write(_json_bytes(manifest)))

    def _write(self, name: str, write: Callable[[IO[bytes]], None], what: str = "") -> None:
        try:
            self.loc.write(name, write)
        except (OSError, pa.ArrowException) as e:
            raise UnwritableOutput(f"{self.loc.uri_of(name)}: {what}cannot be written "
                                   f"({' '.join(str(e).split())})") from e


class UnwritableOutput(Exception):
    """An output file could not be written; the message names the file (and unit) and the OS error."""


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")


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
