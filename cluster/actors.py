"""The decode actor: a Ray Data callable class that loads the verifier once and decodes batches.

Input columns (Ray Data numpy batch): <text_column> (str or None), `path` and `row_hash` (Ray Data's
synthetic source-file and row-position columns, carried through for the driver to place rows).
Output columns (one row per input row, same order): path, row_hash, hyp, status, error, src_len,
hyp_len, iterations, drafted, accepted, accepted_per_iter (list<int32>), decode_ms.
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


class DecodeWorker:
    """One per actor. `__init__` loads the model once; `__call__` decodes a batch in input order."""

    def __init__(self, model_dir: str, options: DecodeOptions, text_column: str, *, device: str = "cpu",
                 torch_threads: int = 1, fail_once_marker: str | None = None):
        torch.set_num_threads(torch_threads)
        self.translator = Translator.load(model_dir, device=device)
        self.options = options
        self.text_column = text_column
        self.fail_once_marker = fail_once_marker

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        """Decode batch[text_column]; returns OUTPUT_SCHEMA rows aligned with the input rows.

        The whole batch goes to one translate_batch call: the engine sorts by length and batches
        continuously under options.max_batch_size / max_tokens, and returns results in input order.
        """
        self._maybe_fail_once()
        texts = ["" if t is None else str(t) for t in batch[self.text_column]]
        results = self.translator.translate_batch(texts, self.options)
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
        return pa.table(cols, schema=OUTPUT_SCHEMA)

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
