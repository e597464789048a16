"""The output table of a commit unit and its statistics.

Columns as aggdec.schema describes them; row i of a unit's output is row start + i of its input file.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from aggdec.schema import DECODED_STATUSES, STATS_COLUMNS, count_status
from aggdec.stats import SpeedupStats


def build_output_table(source: pa.Table, decoded: pa.Table, *, text_column: str, id_column: str | None,
                       passthrough: tuple[str, ...], method: str, stem: str, start: int) -> pa.Table:
    """Join `decoded` (aggdec.schema decoded rows, one per row of `source`, same order) with the input
    rows `source` (rows start.. of input file `stem`). Without an id column, ids are "<stem>:<row>"."""
    if decoded.num_rows != source.num_rows:
        raise RuntimeError(f"{stem}: {decoded.num_rows} decoded rows for {source.num_rows} input rows")
    if id_column:
        ids = pc.cast(source.column(id_column), pa.string())
    else:
        ids = pa.array([f"{stem}:{i}" for i in range(start, start + source.num_rows)], type=pa.string())
    out = {"id": ids, "src": source.column(text_column), "hyp": decoded.column("hyp")}
    for name in passthrough:
        out[name] = source.column(name)
    out["status"] = decoded.column("status")
    out["error"] = decoded.column("error")
    out["method"] = pa.array([method] * source.num_rows, type=pa.string())
    for name in STATS_COLUMNS:
        out[name] = decoded.column(name)
    for name in ("score", "nbest"):
        if name in decoded.column_names:
            out[name] = decoded.column(name)
    return pa.table(out)


def shard_stats(decoded: pa.Table) -> tuple[dict[str, int], SpeedupStats]:
    """(rows per status, SpeedupStats over the ok/truncated rows) -- as aggdec.api.summarize."""
    status = decoded.column("status").to_pylist()
    counts = count_status(status)
    mask = np.isin(np.asarray(status, dtype=object), list(DECODED_STATUSES))

    def total(name: str) -> np.ndarray:
        return decoded.column(name).to_numpy(zero_copy_only=False)[mask]

    stats = SpeedupStats(sentences=int(mask.sum()), iterations=int(total("iterations").sum()),
                         drafted=int(total("drafted").sum()), accepted=int(total("accepted").sum()),
                         output_tokens=int((total("hyp_len") + 1).sum()), decode_ms=float(total("decode_ms").sum()))
    return counts, stats
