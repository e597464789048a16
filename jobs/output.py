"""The output table of a shard and its statistics.

Columns as aggdec.schema describes them; row i of the output is row i of the input file.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from aggdec.schema import STATS_COLUMNS, count_status
from aggdec.stats import SpeedupStats
from jobs.inputs import Shard


def build_output_table(shard: Shard, decoded: pa.Table, *, text_column: str, id_column: str | None,
                       method: str) -> pa.Table:
    """Join `decoded` (aggdec.schema decoded rows in input-row order, one per row) with the input file's columns."""
    if decoded.num_rows != shard.rows:
        raise RuntimeError(f"{shard.path}: {decoded.num_rows} decoded rows for {shard.rows} input rows")
    columns = [text_column, *([id_column] if id_column else []), *shard.passthrough]
    source = pq.read_table(shard.path, columns=columns)
    if source.num_rows != shard.rows:
        raise RuntimeError(f"{shard.path}: has {source.num_rows} rows now, {shard.rows} when the job started")
    if id_column:
        ids = pc.cast(source.column(id_column), pa.string())
    else:
        ids = pa.array([f"{shard.stem}:{i}" for i in range(shard.rows)], type=pa.string())
    out = {"id": ids, "src": source.column(text_column), "hyp": decoded.column("hyp")}
    for name in shard.passthrough:
        out[name] = source.column(name)
    out["status"] = decoded.column("status")
    out["error"] = decoded.column("error")
    out["method"] = pa.array([method] * shard.rows, type=pa.string())
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
    mask = np.isin(np.asarray(status, dtype=object), ["ok", "truncated"])

    def total(name: str) -> np.ndarray:
        return decoded.column(name).to_numpy(zero_copy_only=False)[mask]

    stats = SpeedupStats(sentences=int(mask.sum()), iterations=int(total("iterations").sum()),
                         drafted=int(total("drafted").sum()), accepted=int(total("accepted").sum()),
                         output_tokens=int((total("hyp_len") + 1).sum()), decode_ms=float(total("decode_ms").sum()))
    return counts, stats
