"""What a decode actor does with one commit unit: read its rows, decode, write its output, commit.

`UnitTask` is handed to the decode actors (cluster.actors.DecodeWorker) and called with the actor's
translator and one unit; the driver only sees the unit's small commit record. Rows come straight
from the input file (any pyarrow file system) and the output goes straight to the output location,
so the driver's work and memory grow with the number of units, not rows.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa

from aggdec.api import Translator
from aggdec.decoding.compiled_step import compile_seconds
from aggdec.decoding.options import DecodeOptions
from aggdec.distill import PairFilter, distill_table
from aggdec.schema import decoded_columns, decoded_schema
from jobs.commit import OutputDir, UnwritableOutput
from jobs.output import build_output_table, shard_stats
from jobs.units import Slice, Unit, UnreadableInput, open_slice, pack_content

RECORD_SCHEMA = pa.schema([("unit", pa.string()), ("record", pa.string())])


@dataclass
class UnitTask:
    """Decode units of one job. Picklable; everything a worker needs besides the model."""

    output: str
    text_column: str
    id_column: str | None
    passthrough: tuple[str, ...]
    method: str
    fingerprint: dict
    score: bool = False
    nbest: bool = False
    distill: PairFilter | None = None
    tsv: bool = False
    _out: OutputDir | None = field(default=None, repr=False)

    def __call__(self, translator: Translator, options: DecodeOptions, batch: dict) -> pa.Table:
        """batch: Ray Data rows with a `unit` column (Unit JSON). -> one commit record per unit."""
        records = [self.run(translator, options, Unit.from_json(str(u))) for u in batch["unit"]]
        return pa.table({"unit": [r["unit"] for r in records], "record": [json.dumps(r) for r in records]},
                        schema=RECORD_SCHEMA)

    def run(self, translator: Translator, options: DecodeOptions, unit: Unit) -> dict:
        """Decode and commit `unit`; -> its commit record. An input that cannot be read (gone,
        changed since the job started, damaged) or an output that cannot be written (a full disk)
        yields a record with `failed`, naming the file, the unit and the error, and commits nothing."""
        t0 = time.perf_counter()
        if self._out is None:
            self._out = OutputDir(self.output)
        columns = [self.text_column, *([self.id_column] if self.id_column else []), *self.passthrough]
        try:
            read = [read_rows(part, columns) for part in unit.slices]
        except UnreadableInput as e:
            return {"unit": unit.name, "rows": unit.rows, "failed": str(e)}
        source = pa.concat_tables([part for part, _ in read], promote_options="default")
        content = pack_content([sl.content for _, sl in read]) if unit.members else read[0][1].content
        texts, bad_utf8 = texts_of(source.column(self.text_column))
        backends, compiling, before = Counter(translator.backends), compile_seconds(), translator.drafting(options)
        results = translator.translate_batch(texts, options)
        backends, compiling = translator.backends - backends, compile_seconds() - compiling
        after = translator.drafting(options)
        drafting = {"calls": after["calls"] - before["calls"],
                    "drafting_calls": after["drafting_calls"] - before["drafting_calls"], "budget": after["budget"]}
        for i in bad_utf8:
            results[i].status = "invalid_utf8"
            results[i].error = "the text is not valid UTF-8; invalid bytes were decoded as U+FFFD"
        if self.score:
            translator.rescore(results, max_batch_size=options.max_batch_size, options=options)
        decoded = pa.table(decoded_columns(results, score=self.score, nbest=self.nbest),
                           schema=decoded_schema(score=self.score, nbest=self.nbest))
        tables, at = [], 0
        for part, (rows, _) in zip(unit.slices, read):  # each file's rows keep their own ids
            tables.append(build_output_table(rows, decoded.slice(at, rows.num_rows), text_column=self.text_column,
                                             id_column=self.id_column, passthrough=self.passthrough,
                                             method=self.method, stem=part.stem, start=part.start))
            at += rows.num_rows
        table = pa.concat_tables(tables)
        status, stats = shard_stats(decoded)
        record = {"unit": unit.name, "input": {**unit.identity, "content": content}, "path": unit.path,
                  **({"members": [{"path": m.path, "rows": m.rows} for m in unit.members]} if unit.members else {}),
                  "rows": unit.rows, "hashed_bytes": sum(sl.bytes for _, sl in read),
                  "hash_s": round(sum(sl.seconds for _, sl in read), 4),
                  "output": self._out.loc.uri_of(f"{unit.name}.parquet"), "status": status,
                  "speedup": stats.to_dict(), "fingerprint": self.fingerprint, "backends": dict(backends),
                  "compile_s": round(compiling, 3), "drafting": drafting}
        tsv = None
        if self.distill is not None:
            table, tsv, record["distill"] = distill_table(table, self.distill, tsv=self.tsv)
            record["tsv"] = self._out.loc.uri_of(f"{unit.name}.tsv") if tsv is not None else None
        record["seconds"] = round(time.perf_counter() - t0, 3)
        record["committed_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        record["node"], record["actor"] = _node_id(), _actor_id()
        try:
            self._out.commit(unit.name, table, record, tsv)
        except UnwritableOutput as e:
            return {"unit": unit.name, "rows": unit.rows, "failed": str(e)}
        return record


def _node_id() -> str | None:
    """The Ray node this runs on (None outside Ray): which node decoded a unit."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _actor_id() -> str | None:
    """The Ray actor this runs in (None outside one): which actor decoded a unit."""
    import ray

    return ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None


def read_rows(unit: Unit, columns: list[str]) -> tuple[pa.Table, Slice]:
    """Rows [unit.start, unit.stop) of `columns` from the unit's file, reading only the row groups
    that hold them, and the slice they came from (jobs.units.open_slice: its content hash). Raises
    UnreadableInput naming the file and the unit, and the row group that fails to read."""
    with open_slice(unit) as sl:
        pf = sl.file
        sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
        ends = np.cumsum(sizes)
        starts = ends - np.asarray(sizes, dtype=np.int64)
        groups = [i for i in range(len(sizes)) if starts[i] < unit.stop and ends[i] > unit.start]
        if not groups:
            return pf.schema_arrow.empty_table().select(columns), sl
        parts = []
        for g in groups:
            try:
                parts.append(pf.read_row_group(g, columns=columns))
            except (pa.ArrowException, OSError) as e:
                raise UnreadableInput(f"{unit.path}: row group {g} (rows {starts[g]}-{ends[g]}): "
                                      f"cannot be read ({' '.join(str(e).split())})") from e
        return pa.concat_tables(parts).slice(unit.start - int(starts[groups[0]]), unit.rows), sl


def texts_of(column: pa.ChunkedArray) -> tuple[list[str], list[int]]:
    """The strings of a text column (None -> ""), and the rows whose bytes were not valid UTF-8
    (decoded with U+FFFD for the invalid bytes)."""
    raw = column.cast(pa.binary()).to_pylist()
    texts, bad = [], []
    for i, b in enumerate(raw):
        if b is None:
            texts.append("")
            continue
        try:
            texts.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            texts.append(b.decode("utf-8", errors="replace"))
            bad.append(i)
    return texts, bad
