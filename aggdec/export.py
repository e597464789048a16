"""Text exports of a job's output directory.

fairseq-generate style (`fairseq_lines`), one block per row in natural id order:

    S-<id>\t<src>
    T-<id>\t<ref>                                   (only with a reference column)
    H-<id>\t<score>\t<hyp>
    D-<id>\t<score>\t<hyp>
    I-<id>\t<iterations>\t<accepted_per_iter, space-separated>

<score> is the row's `score` column when the output has one, else 0. H and D carry the same
(detokenised) text, since outputs store only that. I is this project's addition: verifier calls
and the draft tokens accepted at each call. Tabs and line breaks inside text become spaces so
that every record stays on one line. Ids are escaped (`escape_id`): a backslash and every control
character (tab, line breaks, NUL, ...) in an id is written as its Python escape (`\\\\`, `\\t`,
`\\n`, `\\x00`, `\\u2028`), so that an id stays one field of one line and two ids stay two.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from aggdec.schema import id_sort_key, output_files, read_outputs

FAIRSEQ_COLUMNS = ("id", "src", "hyp", "iterations", "accepted_per_iter")


_ESCAPES = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}


def escape_id(id_: str) -> str:
    """`id_` with a backslash and every control character (Unicode categories Cc, Zl, Zp) written as
    a Python escape: one field of one line, from which the id reads back unambiguously."""
    if id_.isprintable() and "\\" not in id_:
        return id_
    return "".join(_ESCAPES.get(ch) or (
        (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp") else ch) for ch in id_)


def _one_line(text: str | None) -> str:
    return "" if text is None else " ".join(text.replace("\t", " ").splitlines())


def fairseq_lines(out_dir: str | Path, *, ref_column: str | None = None) -> Iterator[str]:
    """fairseq-generate-style lines (no trailing newline) for every row of an output directory.

    Raises ValueError naming the shard and column when a needed column (FAIRSEQ_COLUMNS, `ref_column`)
    is missing. Reads `score` when present.
    """
    has_score = all("score" in pq.read_schema(f).names for f in output_files(out_dir))
    columns = [*FAIRSEQ_COLUMNS, *([ref_column] if ref_column else []), *(["score"] if has_score else [])]
    rows = read_outputs(out_dir, columns).to_pylist()
    rows.sort(key=lambda row: id_sort_key(str(row["id"])))
    for row in rows:
        id_, hyp = escape_id(str(row["id"])), _one_line(row["hyp"])
        score = row["score"] if has_score and row["score"] is not None else 0
        yield f"S-{id_}\t{_one_line(row['src'])}"
        if ref_column:
            yield f"T-{id_}\t{_one_line(row[ref_column])}"
        yield f"H-{id_}\t{score}\t{hyp}"
        yield f"D-{id_}\t{score}\t{hyp}"
        yield f"I-{id_}\t{row['iterations']}\t{' '.join(str(a) for a in row['accepted_per_iter'] or [])}"
