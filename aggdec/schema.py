"""What a decoded corpus holds: the columns and types of output rows, the manifest's name, readers.

One output row per input row, columns in this order:

    id (string), src (the input text as stored), hyp,
    <passthrough columns: the input's other columns, types unchanged>,
    status, error, method, src_len, hyp_len, iterations, drafted, accepted,
    accepted_per_iter (list<int32>), decode_ms,
    score (float64), nbest (list<struct<hyp, score>>)      when asked for,
    kept (bool), filter_reason (string)                      distill jobs (aggdec.distill)

`DECODED` is what decoding produces per row (from `TranslationResult`s, `decoded_columns`); an
output directory holds one Parquet file per input file plus `_manifest.json` (MANIFEST_NAME).
Used by the decode actors, jobs, `aggdec decode --stats`, eval, report and export alike.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST_NAME = "_manifest.json"

STATUSES = ("ok", "empty", "truncated", "truncated_output", "unknown_tokens", "invalid_utf8", "invalid_output",
            "lost_characters", "error")
"""Row statuses: ok; empty (nothing to decode); truncated (the source was cut to the model's
positions); truncated_output (the output was cut at the length limit); unknown_tokens (most of the
source is text the vocabulary lacks); invalid_utf8 (the input bytes were not UTF-8; invalid bytes
read as U+FFFD); invalid_output (the output's byte tokens do not form UTF-8: its text holds U+FFFD
the source does not); lost_characters (the tokenizer drops characters of the source, such as
bidirectional marks, or has no piece for them: the model never saw them); error (decoding the row
raised). `error` says why, and names the characters, for all but ok and empty."""
DECODED_STATUSES = ("ok", "truncated", "truncated_output", "unknown_tokens", "invalid_utf8", "invalid_output",
                    "lost_characters")
"""Statuses of rows that were decoded (their statistics count)."""

DECODED = pa.schema([
    ("hyp", pa.string()),
    ("status", pa.string()),
    ("error", pa.string()),
    ("src_len", pa.int32()),
    ("hyp_len", pa.int32()),
    ("iterations", pa.int32()),
    ("drafted", pa.int32()),
    ("accepted", pa.int32()),
    ("accepted_per_iter", pa.list_(pa.int32())),
    ("decode_ms", pa.float64()),
])
"""Per-row decoding results. src_len: source tokens incl. eos; hyp_len: output tokens without eos;
iterations: verifier calls; drafted / accepted: draft tokens proposed / kept; accepted_per_iter:
accepted draft tokens at each call; decode_ms: the row's share of decoding time."""

SCORE = pa.field("score", pa.float64())
NBEST = pa.field("nbest", pa.list_(pa.struct([("hyp", pa.string()), ("score", pa.float64())])))
STATS_COLUMNS = ("src_len", "hyp_len", "iterations", "drafted", "accepted", "accepted_per_iter", "decode_ms")
RESULT_COLUMNS = ("status", "error", "method", *STATS_COLUMNS)
"""Columns written after the passthrough columns (besides the optional ones)."""


def decoded_schema(*, score: bool = False, nbest: bool = False) -> pa.Schema:
    """DECODED plus the optional `score` and `nbest` columns."""
    schema = DECODED
    if score:
        schema = schema.append(SCORE)
    if nbest:
        schema = schema.append(NBEST)
    return schema


def decoded_columns(results: Sequence[Any], *, score: bool = False, nbest: bool = False) -> dict[str, list]:
    """`decoded_schema(score=, nbest=)` columns of `aggdec.api.TranslationResult`s."""
    cols = {
        "hyp": [r.text for r in results],
        "status": [r.status for r in results],
        "error": [r.error for r in results],
        "src_len": [r.src_len for r in results],
        "hyp_len": [len(r.tokens) for r in results],
        "iterations": [r.stats.iterations for r in results],
        "drafted": [r.stats.drafted for r in results],
        "accepted": [r.stats.accepted for r in results],
        "accepted_per_iter": [list(r.stats.accepted_per_iter) for r in results],
        "decode_ms": [float(r.stats.decode_ms) for r in results],
    }
    if score:
        cols["score"] = [r.score for r in results]
    if nbest:
        cols["nbest"] = [[{"hyp": h, "score": s} for h, s in r.nbest] for r in results]
    return cols


def count_status(statuses: Iterable[str]) -> dict[str, int]:
    """{status: rows}, in order of first appearance."""
    return dict(Counter(statuses))


# -- readers --------------------------------------------------------------------------------------

def output_files(path: str | Path) -> list[Path]:
    """The Parquet shards of an output directory (`*.parquet`, sorted by name), or [path] for one file."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such output directory or Parquet file")
    files = sorted(p for p in path.glob("*.parquet") if not p.name.startswith("."))
    if not files:
        raise FileNotFoundError(f"{path}: no *.parquet files (is this a job's output directory?)")
    return files


def read_outputs(path: str | Path, columns: Sequence[str] | None = None) -> pa.Table:
    """All rows of an output directory (or one Parquet file), shards concatenated in file-name order.

    `columns`: read only these; a shard that lacks one raises ValueError naming the shard and column.
    """
    tables = []
    for file in output_files(path):
        names = pq.read_schema(file).names
        missing = [c for c in (columns or ()) if c not in names]
        if missing:
            raise ValueError(f"{file}: no column {missing[0]!r} (columns: {', '.join(names)})")
        tables.append(pq.read_table(file, columns=list(columns) if columns is not None else None))
    try:
        return pa.concat_tables(tables, promote_options="default")
    except pa.ArrowInvalid as e:
        raise ValueError(f"{path}: shards have incompatible schemas: {e}") from e


def read_manifest(path: str | Path) -> dict[str, Any] | None:
    """The job's `_manifest.json` in output directory `path`, or None when there is none."""
    file = Path(path) / MANIFEST_NAME
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON: {e}") from e


def read_by_id(path: str | Path, column: str = "hyp") -> dict[str, str]:
    """{id: text of `column`} over an output directory; None becomes "". Duplicate ids raise ValueError."""
    table = read_outputs(path, ["id", column])
    out: dict[str, str] = {}
    for id_, text in zip(table.column("id").to_pylist(), table.column(column).to_pylist()):
        key = str(id_)
        if key in out:
            raise ValueError(f"{path}: id {key!r} occurs more than once")
        out[key] = "" if text is None else str(text)
    return out


def id_sort_key(id_: str) -> list[Any]:
    """Natural order for ids: digit runs compare as numbers, so "part-0:2" < "part-0:10" and "9" < "10"."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", id_))]
