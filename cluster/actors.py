"""The decode actor: a Ray Data callable class that loads the verifier once and decodes batches.

Input columns (Ray Data numpy batch): <text_column> (str or None), `path` and `row_hash` (Ray Data's
synthetic source-file and row-position columns, carried through for the driver to place rows).
Output columns (one row per input row, same order): path, row_hash, hyp, status, error, src_len,
hyp_len, iterations, drafted, accepted, accepted_per_iter (list<int32>), decode_ms; then, if asked
for, score (float64, null for empty/error rows) and nbest (list<struct<hyp: string, score: double>>,
when options.nbest > 1) -- see `output_schema`.
A row that fails to decode comes back with status "error" (the engine isolates failing rows);
a batch never fails because of a row.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import torch

from aggdec.api import DecodeOptions, Translator

OUTPUT_SCHEMA = pa.schema([
    ("path", pa.string()),
    ("row_hash", pa.uint64()),
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
NBEST_TYPE = pa.list_(pa.struct([("hyp", pa.string()), ("score", pa.float64())]))


def output_schema(*, score: bool = False, nbest: bool = False) -> pa.Schema:
    """OUTPUT_SCHEMA plus the optional `score` and `nbest` columns."""
    schema = OUTPUT_SCHEMA
    if score:
        schema = schema.append(pa.field("score", pa.float64()))
    if nbest:
        schema = schema.append(pa.field("nbest", NBEST_TYPE))
    return schema


class DecodeWorker:
    """One per actor. `__init__` loads the model once; `__call__` decodes a batch in input order.

    score=True adds the `score` column (methods other than beam: one extra teacher-forced pass,
    Translator.rescore); options.nbest > 1 adds the `nbest` column.
    """

    def __init__(self, model_dir: str, options: DecodeOptions, text_column: str, *, device: str = "cpu",
                 torch_threads: int = 1, fail_once_marker: str | None = None, score: bool = False):
        torch.set_num_threads(torch_threads)
        self.translator = Translator.load(model_dir, device=device)
        self.options = options
        self.text_column = text_column
        self.fail_once_marker = fail_once_marker
        self.score = score
        self.schema = output_schema(score=score, nbest=options.nbest > 1)

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        """Decode batch[text_column]; returns `self.schema` rows aligned with the input rows.

        The whole batch goes to one translate_batch call: the engine sorts by length and batches
        continuously under options.max_batch_size / max_tokens, and returns results in input order.
        """
        self._maybe_fail_once()
        texts = ["" if t is None else str(t) for t in batch[self.text_column]]
        results = self.translator.translate_batch(texts, self.options)
        if self.score:
            self.translator.rescore(results, max_batch_size=self.options.max_batch_size)
        cols = {
            "path": [str(p) for p in batch["path"]],
            "row_hash": np.asarray(batch["row_hash"], dtype=np.uint64),
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
        if self.score:
            cols["score"] = [r.score for r in results]
        if self.options.nbest > 1:
            cols["nbest"] = [[{"hyp": h, "score": sc} for h, sc in r.nbest] for r in results]
        return pa.table(cols, schema=self.schema)

    def _maybe_fail_once(self) -> None:
        """Test hook: the first call anywhere creates the marker file and kills this actor's process."""
        if not self.fail_once_marker:
            return
        try:
            fd = os.open(self.fail_once_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"killed pid {os.getpid()}\n".encode())
        os.close(fd)
        os._exit(1)
