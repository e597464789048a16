"""Commit units: the (input file, row range) slices a job decodes, commits and resumes by.

A file of at most `rows_per_task` rows is one unit named after the file's stem (`part-00001` ->
`OUT/part-00001.parquet`); a larger file is cut into ranges of `rows_per_task` rows named
`<stem>.rows-<start>-<stop>` (zero-padded, so names sort in input order). Consecutive whole files of
fewer than `pack_rows` rows each are packed into one unit of at most `pack_rows` rows, named
`<first stem>.pack-<files>` (`part-00000.pack-128.parquet`): its output holds their rows in input
order, each row keeping its own id (`<file stem>:<row>` without an id column), and its commit record
lists the files (`members`). Boundaries depend only on the files, `rows_per_task` and `pack_rows`,
never on the cluster, so a rerun on another cluster finds the same units. Each unit is one task of a
decode actor, which reads its own rows and writes its own output.

A unit's input identity is its file's size and footer hash and its row range, planned from the
footer, plus the content hash of its slice (CONTENT_HASH of the CONTENT_HASH of the bytes of every
row group that holds its rows, all columns), which the actor computes as it reads the unit and
records; a pack's is its files' identities, and the hash of their hashes. A rerun reuses a committed
unit only where every slice hashes the same again (`slice_contents`, each row group read once), so
that any change of an input value is decoded again (a pack's whole unit, where one of its files changed).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
HASH_THREADS = 8
"""Files hashed at once when a job checks its committed units (reading is most of it)."""


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
    members: tuple[Unit, ...] = ()
    """A pack's files, each a whole-file unit (the pack's path and stem are its first file's, its rows
    0..the sum of theirs, its identity theirs); empty for a slice of one file."""

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def slices(self) -> tuple[Unit, ...]:
        """The single-file units this one reads, in order: a pack's files, else itself."""
        return self.members or (self,)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Unit:
        fields = json.loads(text)
        return cls(**{**fields, "members": tuple(cls(**m) for m in fields.get("members", ()))})


def plan_units(shards: list[Shard], rows_per_task: int, pack_rows: int = 0) -> list[Unit]:
    """The units of `shards`, in input order (empty files are one empty unit); consecutive files of
    fewer than `pack_rows` rows each packed into units of at most `pack_rows` rows (0: none packed)."""
    units = []
    for s in shards:
        ranges = [(0, s.rows)] if s.rows <= rows_per_task else [
            (a, min(a + rows_per_task, s.rows)) for a in range(0, s.rows, rows_per_task)]
        width = max(10, len(str(s.rows)))
        for a, b in ranges:
            name = s.stem if len(ranges) == 1 else f"{s.stem}.rows-{a:0{width}d}-{b:0{width}d}"
            units.append(Unit(path=s.path, stem=s.stem, start=a, stop=b, name=name,
                              identity={**dict(s.identity), "start": a, "stop": b}))
    return _packed(units, min(pack_rows, rows_per_task))


def _packed(units: list[Unit], pack_rows: int) -> list[Unit]:
    """`units` with each run of consecutive whole files of fewer than `pack_rows` rows cut into packs of
    at most `pack_rows` rows (a pack of one file stays that file's unit)."""
    packed: list[Unit] = []
    run: list[Unit] = []

    def close() -> None:
        packed.append(run[0] if len(run) == 1 else Unit(
            path=run[0].path, stem=run[0].stem, start=0, stop=sum(u.rows for u in run),
            name=f"{run[0].name}.pack-{len(run)}", identity={"members": [u.identity for u in run]},
            members=tuple(run)))
        run.clear()

    rows = 0  # of `run`
    for unit in units:
        small = unit.name == unit.stem and unit.rows < pack_rows
        if run and (not small or rows + unit.rows > pack_rows):
            close()
            rows = 0
        if small:
            run.append(unit)
            rows += unit.rows
        else:
            packed.append(unit)
    if run:
        close()
    return packed


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
            if dict(identity) != _planned(unit):
                raise UnreadableInput(f"{unit.path}: unit {unit.name}: the file changed since the job started "
                                      f"({_changed(dict(identity), _planned(unit))}); a rerun decodes it as it is then")
            t0 = time.perf_counter()
            content, size = _content(f, meta, unit, {})
            yield Slice(pq.ParquetFile(f, metadata=meta), content, size, time.perf_counter() - t0)
    except (pa.ArrowException, OSError) as e:
        raise UnreadableInput(f"{unit.path}: unit {unit.name}: cannot be read ({' '.join(str(e).split())})") from e


def pack_content(contents: list[str]) -> str:
    """The content hash of a pack: "<CONTENT_HASH>:<hex>" of its files' slices' hashes, in order."""
    joined = "\n".join(contents).encode()
    return f"{CONTENT_HASH}:{hashlib.new(CONTENT_HASH, joined).hexdigest()}"


def slice_contents(units: list[Unit]) -> list[str | None]:
    """The content hash of each unit's slices as their files are now (as open_slice computes it, and
    `pack_content` for a pack), each row group of each file read once, HASH_THREADS files at a time;
    None where a file cannot be read or no longer matches the unit's plan."""
    found = iter(_slice_contents([part for unit in units for part in unit.slices]))
    contents = []
    for unit in units:
        parts = [next(found) for _ in unit.slices]
        contents.append(None if None in parts else pack_content(parts) if unit.members else parts[0])
    return contents


def _slice_contents(units: list[Unit]) -> list[str | None]:
    """`slice_contents` of single-file units."""
    by_file: dict[str, list[int]] = {}
    for i, unit in enumerate(units):
        by_file.setdefault(unit.path, []).append(i)

    def of_file(path: str, indices: list[int]) -> dict[int, str | None]:
        fs, inner = resolve(path)
        try:
            with fs.open_input_file(inner) as f:
                identity, meta = file_identity(f)
                groups: dict[int, bytes] = {}
                return {i: _content(f, meta, units[i], groups)[0] if dict(identity) == _planned(units[i]) else None
                        for i in indices}
        except (pa.ArrowException, OSError):
            return dict.fromkeys(indices)

    contents: dict[int, str | None] = {}
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        for found in pool.map(of_file, by_file, by_file.values()):
            contents.update(found)
    return [contents[i] for i in range(len(units))]


def _planned(unit: Unit) -> dict:
    return {k: unit.identity[k] for k in ("size", "footer_sha")}


def _content(f: pa.NativeFile, meta: pq.FileMetaData, unit: Unit, groups: dict[int, bytes]) -> tuple[str, int]:
    """("<CONTENT_HASH>:<hex>" of the unit's slice, bytes read): the hash of the hashes of the bytes
    of every row group holding its rows. `groups` holds row groups' hashes already read (and gets
    those this reads)."""
    size = 0
    spans = _group_spans(meta, unit.start, unit.stop)
    for g, (a, b) in spans.items():
        if g in groups:
            continue
        digest = hashlib.new(CONTENT_HASH)
        f.seek(a)
        while a < b:
            block = f.read(min(HASH_BLOCK, b - a))
            if not block:
                raise OSError(f"the file ends at byte {a}, inside row group {g}")
            digest.update(block)
            a += len(block)
            size += len(block)
        groups[g] = digest.digest()
    return f"{CONTENT_HASH}:{hashlib.new(CONTENT_HASH, b''.join(groups[g] for g in spans)).hexdigest()}", size


def _group_spans(meta: pq.FileMetaData, start: int, stop: int) -> dict[int, tuple[int, int]]:
    """{row group: [byte start, byte end)} of each row group holding rows of [start, stop): from its
    first column chunk's first page (dictionary or data) to the end of its last."""
    spans, first = {}, 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        if first < stop and first + rg.num_rows > start:
            chunks = [rg.column(c) for c in range(rg.num_columns)]
            begins = [c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset
                      else c.data_page_offset for c in chunks]
            spans[g] = (min(begins), max(b + c.total_compressed_size for b, c in zip(begins, chunks)))
        first += rg.num_rows
    return spans


def _changed(now: dict, planned: dict) -> str:
    return ", ".join(f"{k} {planned[k]} then, {now[k]} now" for k in planned if now[k] != planned[k])
