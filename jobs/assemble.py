"""Driver side of the pipeline: place decoded rows back into their input shards, exactly once.

Ray Data delivers decoded rows in any order, from any actor, and (after an actor died and its task
was retried) possibly twice. Each row carries `path` and `row_hash`; `row_hash` is Ray Data's
deterministic bijection of (file path, row position), so inverting it gives the row number.
`ShardAssembler.add` drops rows already seen, and hands back a shard, sorted by row number, as
soon as every one of its rows (count from the Parquet footer) has arrived.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from jobs.inputs import Shard


def row_hashes(path: str, num_rows: int) -> np.ndarray:
    """The uint64 `row_hash` Ray Data gives rows 0..num_rows-1 of `path` (include_row_hash=True).

    Ray's own function when importable (ray.data private API), else the same published formula:
    md5(path) seed + row index, then the splitmix64 finalizer. `ShardAssembler` checks every hash it
    receives against these, so a change in Ray's scheme fails loudly instead of misplacing rows.
    """
    try:
        from ray.data._internal.datasource_v2.common.synthesized_columns import _compute_row_hashes

        return np.asarray(_compute_row_hashes(path, 0, num_rows), dtype=np.uint64)
    except ImportError:
        pass
    seed = np.uint64(int.from_bytes(hashlib.md5(path.encode("utf-8")).digest()[:8], "little"))
    keys = seed + np.arange(num_rows, dtype=np.uint64)
    keys ^= keys >> np.uint64(30)
    keys *= np.uint64(0xBF58476D1CE4E5B9)
    keys ^= keys >> np.uint64(27)
    keys *= np.uint64(0x94D049BB133111EB)
    keys ^= keys >> np.uint64(31)
    return keys


@dataclass
class _Pending:
    shard: Shard
    seen: np.ndarray  # (rows,) bool
    parts: list[pa.Table] = field(default_factory=list)
    row_ids: list[np.ndarray] = field(default_factory=list)
    duplicates: int = 0
    _sorted_hashes: np.ndarray | None = None
    _order: np.ndarray | None = None
    _hash_path: str | None = None

    def rows_of(self, ray_path: str, hashes: np.ndarray) -> np.ndarray:
        """Row numbers of `hashes`; raises if one is not a row of this shard."""
        if self._hash_path != ray_path:
            h = row_hashes(ray_path, self.shard.rows)
            self._order = np.argsort(h, kind="stable")
            self._sorted_hashes, self._hash_path = h[self._order], ray_path
        pos = np.searchsorted(self._sorted_hashes, hashes)
        pos = np.minimum(pos, len(self._sorted_hashes) - 1)
        bad = self._sorted_hashes[pos] != hashes
        if bad.any():
            raise RuntimeError(f"{self.shard.path}: {int(bad.sum())} decoded rows carry a row_hash that matches no "
                               f"row of the file; Ray Data's row_hash scheme may have changed")
        return self._order[pos]


class ShardAssembler:
    """Collects decoded rows per shard; `add` returns the shards completed by a batch."""

    def __init__(self, shards: list[Shard]):
        self._pending = {_key(s.path): _Pending(s, np.zeros(s.rows, dtype=bool)) for s in shards if s.rows > 0}
        self.duplicates = 0

    def add(self, table: pa.Table) -> list[tuple[Shard, pa.Table]]:
        """Take decoded rows (columns path, row_hash, ...); -> [(shard, rows sorted by row number)]."""
        done = []
        paths = table.column("path")
        for ray_path in pc.unique(paths).to_pylist():
            pend = self._pending.get(_key(ray_path))
            if pend is None:
                self.duplicates += int(pc.sum(pc.equal(paths, ray_path)).as_py() or 0)
                continue  # a late duplicate of a shard already handed back
            sub = table.filter(pc.equal(paths, ray_path))
            rows = pend.rows_of(ray_path, sub.column("row_hash").to_numpy())
            _, first = np.unique(rows, return_index=True)
            keep = np.zeros(len(rows), dtype=bool)
            keep[first] = True
            keep &= ~pend.seen[rows]
            pend.duplicates += int((~keep).sum())
            self.duplicates += int((~keep).sum())
            if keep.any():
                pend.parts.append(sub.filter(pa.array(keep)))
                pend.row_ids.append(rows[keep])
                pend.seen[rows[keep]] = True
            if pend.seen.all():
                del self._pending[_key(ray_path)]
                order = np.argsort(np.concatenate(pend.row_ids), kind="stable")
                done.append((pend.shard, pa.concat_tables(pend.parts).take(pa.array(order))))
        return done

    def missing(self) -> dict[str, int]:
        """{shard path: rows not yet received} for shards not handed back."""
        return {p.shard.path: int((~p.seen).sum()) for p in self._pending.values()}


def _key(path: str) -> str:
    if "://" in path:
        path = path.split("://", 1)[1]
    return os.path.realpath(path) if os.path.isabs(path) else path
