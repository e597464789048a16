"""Input shards: list the Parquet files of a spec and check every footer before any Ray work starts.

A shard is one input file, local or on any pyarrow file system (jobs.storage). Its outputs are
named after its stem (stem_of: a hidden file's with a prefix, so that readers of the output see
it), so stems must be unique. Checks (errors name the file and column): the path
exists and matches files; each file opens as Parquet (a corrupt footer names the file); the text
column exists and is a string column; the id column (if any) exists and is string or integer; all
files have the same columns; no input column clashes with an output column. Each shard records its
identity (size and a hash of its footer); each commit unit adds the hash of its rows' bytes
(jobs.units), so that a rerun notices any changed input.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from aggdec.schema import RESULT_COLUMNS
from jobs.spec import JobSpec, SpecError
from jobs.storage import glob_base, is_glob, is_hidden, list_files, location_key, resolve, within


@dataclass(frozen=True)
class Shard:
    """One input file. `path`: an absolute local path or a URI; `rows` and `row_groups` (rows per row
    group) come from the Parquet footer; `identity`: {"size", "footer_sha"}."""

    path: str
    stem: str
    rows: int
    schema: pa.Schema
    passthrough: tuple[str, ...]  # input columns copied to the output unchanged
    row_groups: tuple[int, ...] = ()
    identity: tuple[tuple[str, object], ...] = ()


def list_input_files(path: str, hidden: list[str] | None = None) -> list[str]:
    """A file, a directory (its *.parquet files, skipping hidden names: starting with '_' or '.'), or
    a glob (hidden names too), local or a URI. `hidden` receives the names a directory skips."""
    try:
        files = list_files(path, hidden)
    except FileNotFoundError:
        raise SpecError(f"input.path: {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise SpecError(f"input.path: {path}: {e}") from e
    if not files and is_glob(path):
        raise SpecError(f"input.path: no files match {path}")
    if not files:
        raise SpecError(f"input.path: directory {path} has no *.parquet files")
    return files


def file_identity(f: pa.NativeFile) -> tuple[tuple[tuple[str, object], ...], pq.FileMetaData]:
    """(identity: size and footer hash, metadata) of an open Parquet file; raises pa.ArrowInvalid
    where the file does not end in a Parquet footer."""
    size = f.size()
    f.seek(max(0, size - 8))
    tail = f.read(8)
    length = int.from_bytes(tail[:4], "little") if len(tail) == 8 and tail[4:] == b"PAR1" else -1
    if not 0 <= length <= size - 12:
        raise pa.ArrowInvalid("no Parquet footer at the end of the file")
    f.seek(size - 8 - length)
    sha = hashlib.sha256(f.read(length)).hexdigest()[:16]
    return (("size", size), ("footer_sha", sha)), pq.ParquetFile(f).metadata


def read_footer(path: str) -> tuple[pa.Schema, int, tuple[int, ...], tuple[tuple[str, object], ...]]:
    """(Arrow schema, rows, rows per row group, identity) from a Parquet footer; a file that is not
    valid Parquet names the file."""
    fs, inner = resolve(path)
    try:
        with fs.open_input_file(inner) as f:
            identity, meta = file_identity(f)
            schema = meta.schema.to_arrow_schema()
            groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
            return schema, meta.num_rows, groups, identity
    except (pa.ArrowException, OSError) as e:
        raise SpecError(f"{path}: not a readable Parquet file ({e})") from e


HIDDEN_OUTPUT_PREFIX = "hidden-"
"""Prefix of the outputs of hidden input files (`.a.parquet` -> `hidden-.a.parquet`), which Parquet
readers would otherwise skip in the output directory."""


def stem_of(path: str) -> str:
    """The output name of an input file, without `.parquet`: the file's name without its extension,
    prefixed with HIDDEN_OUTPUT_PREFIX where the name is hidden (starts with '_' or '.')."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    stem = name[: -len(".parquet")] if name.endswith(".parquet") else name.rsplit(".", 1)[0] if "." in name else name
    return HIDDEN_OUTPUT_PREFIX + stem if is_hidden(name) else stem


def inspect_inputs(spec: JobSpec) -> list[Shard]:
    """All shards of `spec.input`, schemas checked. Raises SpecError naming the file and column."""
    text, id_col = spec.input.text_column, spec.input.id_column
    reserved = {"id", "src", "hyp", *RESULT_COLUMNS, "score", "nbest", "kept", "filter_reason"}
    shards: list[Shard] = []
    stems: dict[str, str] = {}
    first: tuple[str, pa.Schema] | None = None
    for path in list_input_files(spec.input.path):
        stem = stem_of(path)
        if stem in stems:
            raise SpecError(f"{path}: same output name {stem}.parquet as {stems[stem]}; rename one of them")
        stems[stem] = path
        schema, rows, groups, identity = read_footer(path)
        _check_column(path, schema, text, "input.text_column", ("string",))
        if id_col is not None:
            _check_column(path, schema, id_col, "input.id_column", ("string", "integer"))
        passthrough = tuple(n for n in schema.names if n not in (text, id_col))
        for name in passthrough:
            if name in reserved:
                raise SpecError(f"{path}: column {name!r} clashes with an output column of the same name; "
                                f"rename it{' or set input.id_column = ' + repr(name) if name == 'id' else ''}")
        if first is None:
            first = (path, schema)
        elif not schema.equals(first[1]):
            raise SpecError(f"{path}: columns {_describe(schema)} differ from {first[0]}: {_describe(first[1])}")
        shards.append(Shard(path=path, stem=stem, rows=rows, schema=schema, passthrough=passthrough,
                            row_groups=groups, identity=identity))
    return shards


def input_locations(spec: JobSpec, shards: list[Shard]) -> dict[str, str]:
    """{location key (jobs.storage.location_key): path as given} of every input of `spec`: each input
    file, and input.path itself where it is a file or directory (for a glob, the directory it searches
    when it is recursive, `**`)."""
    path = spec.input.path
    roots = [glob_base(path)] if is_glob(path) and "**" in path else [] if is_glob(path) else [path]
    return {location_key(p): p for p in [*roots, *(s.path for s in shards)]}


def check_output_apart(spec: JobSpec, shards: list[Shard]) -> None:
    """Refuse (SpecError, one line naming both) an output.dir that is an input, lies inside one or
    holds one (compared after resolving links; URIs by prefix): the job would write over, or clean
    up, its own inputs."""
    out = location_key(spec.output.dir)
    for key, path in input_locations(spec, shards).items():
        if within(out, key) or within(key, out):
            how = "is" if out == key else "is inside" if within(out, key) else "contains"
            raise SpecError(f"output.dir: {spec.output.dir} {how} the input {path}; a job never writes where its "
                            "inputs are: choose an output.dir apart from input.path")


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
