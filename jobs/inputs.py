"""Input shards: list the Parquet files of a spec and check every schema before any Ray work starts.

A shard is one input file. Its output is <output.dir>/<stem>.parquet, so stems must be unique.
Checks (errors name the file and column): the path exists and matches files; each file opens as
Parquet (a corrupt file names the file); the text column exists and is a string column; the id
column (if any) exists and is string or integer; all files have the same columns; no input column
clashes with an output column or with Ray Data's synthetic `path`/`row_hash` columns.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from aggdec.schema import RESULT_COLUMNS
from jobs.spec import JobSpec, SpecError

RAY_SYNTHETIC = ("path", "row_hash")


@dataclass(frozen=True)
class Shard:
    """One input file. `path` is absolute; `rows` comes from the Parquet footer."""

    path: str
    stem: str
    rows: int
    schema: pa.Schema
    passthrough: tuple[str, ...]  # input columns copied to the output unchanged


def list_input_files(path: str) -> list[str]:
    """A file, a directory (its *.parquet files, skipping names starting with '_' or '.'), or a glob."""
    if any(ch in path for ch in "*?["):
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not files:
            raise SpecError(f"input.path: no files match {path}")
        return [os.path.abspath(p) for p in files]
    p = Path(path)
    if p.is_dir():
        files = sorted(str(f) for f in p.iterdir()
                       if f.is_file() and f.suffix == ".parquet" and not f.name.startswith(("_", ".")))
        if not files:
            raise SpecError(f"input.path: directory {path} has no *.parquet files")
        return files
    if p.is_file():
        return [str(p.resolve())]
    raise SpecError(f"input.path: {path} does not exist")


def read_schema(path: str) -> tuple[pa.Schema, int]:
    """(Arrow schema, row count) from a Parquet footer; a file that is not valid Parquet names the file."""
    try:
        f = pq.ParquetFile(path)
        return f.schema_arrow, f.metadata.num_rows
    except (pa.ArrowException, OSError) as e:
        raise SpecError(f"{path}: not a readable Parquet file ({e})") from e


def inspect_inputs(spec: JobSpec) -> list[Shard]:
    """All shards of `spec.input`, schemas checked. Raises SpecError naming the file and column."""
    text, id_col = spec.input.text_column, spec.input.id_column
    reserved = {"id", "src", "hyp", *RESULT_COLUMNS, "score", "nbest", "kept", "filter_reason"}
    shards: list[Shard] = []
    stems: dict[str, str] = {}
    first: tuple[str, pa.Schema] | None = None
    for path in list_input_files(spec.input.path):
        stem = Path(path).stem
        if stem in stems:
            raise SpecError(f"{path}: same output name {stem}.parquet as {stems[stem]}; rename one of them")
        stems[stem] = path
        schema, rows = read_schema(path)
        _check_column(path, schema, text, "input.text_column", ("string",))
        if id_col is not None:
            _check_column(path, schema, id_col, "input.id_column", ("string", "integer"))
        for name in schema.names:
            if name in RAY_SYNTHETIC:
                raise SpecError(f"{path}: column {name!r} clashes with Ray Data's synthetic {name!r} column; rename it")
        passthrough = tuple(n for n in schema.names if n not in (text, id_col))
        for name in passthrough:
            if name in reserved:
                raise SpecError(f"{path}: column {name!r} clashes with an output column of the same name; "
                                f"rename it{' or set input.id_column = ' + repr(name) if name == 'id' else ''}")
        if first is None:
            first = (path, schema)
        elif not schema.equals(first[1]):
            raise SpecError(f"{path}: columns {_describe(schema)} differ from {first[0]}: {_describe(first[1])}")
        shards.append(Shard(path=path, stem=stem, rows=rows, schema=schema, passthrough=passthrough))
    return shards


def _check_column(path: str, schema: pa.Schema, column: str, field: str, kinds: tuple[str, ...]) -> None:
    if column not in schema.names:
        raise SpecError(f"{path}: no column {column!r} ({field}); columns are {schema.names}")
    typ = schema.field(column).type
    ok = (("string" in kinds and (pa.types.is_string(typ) or pa.types.is_large_string(typ)))
          or ("integer" in kinds and pa.types.is_integer(typ)))
    if not ok:
        raise SpecError(f"{path}: column {column!r} ({field}) must be {' or '.join(kinds)}, got {typ}")


def _describe(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)
