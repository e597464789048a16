"""The decode actor: a Ray Data callable class that loads the verifier once and decodes batches.

Input columns (Ray Data numpy batch): <text_column> (str or None), `path` and `row_hash` (Ray Data's
synthetic source-file and row-position columns, carried through for the driver to place rows).
Output columns (one row per input row, same order): path, row_hash, then aggdec.schema's decoded
columns (hyp, status, ... decode_ms; score and nbest when asked for) -- see `output_schema`.
A row that fails to decode comes back with status "error" (the engine isolates failing rows);
a batch never fails because of a row.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from aggdec.api import DecodeOptions, Translator
from aggdec.schema import decoded_columns, decoded_schema

ROW_COLUMNS = pa.schema([("path", pa.string()), ("row_hash", pa.uint64())])
"""Ray Data's synthetic source-file and row-position columns, carried through each decoded row."""


def output_schema(*, score: bool = False, nbest: bool = False) -> pa.Schema:
    """ROW_COLUMNS plus aggdec.schema.decoded_schema(score=, nbest=)."""
    return pa.schema([*ROW_COLUMNS, *decoded_schema(score=score, nbest=nbest)])


class DecodeWorker:
    """One per actor. `__init__` loads the model once; `__call__` decodes a batch in input order.

    score=True adds the `score` column (methods other than beam: one extra teacher-forced pass,
    Translator.rescore); beam's nbest > 1 adds the `nbest` column.
    """

    def __init__(self, model_dir: str, options: DecodeOptions, text_column: str, *, device: str = "cpu",
                 torch_threads: int = 1, score: bool = False):
        torch.set_num_threads(torch_threads)
        self.translator = Translator.load(model_dir, device=device)
        self.options = options
        self.text_column = text_column
        self.score = score
        self.nbest = getattr(options, "nbest", 1) > 1
        self.schema = output_schema(score=score, nbest=self.nbest)

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        """Decode batch[text_column]; returns `self.schema` rows aligned with the input rows.

        The whole batch goes to one translate_batch call: the engine sorts by length and batches
        continuously under options.max_batch_size / max_tokens, and returns results in input order.
        """
        texts = ["" if t is None else str(t) for t in batch[self.text_column]]
        results = self.translator.translate_batch(texts, self.options)
        if self.score:
            self.translator.rescore(results, max_batch_size=self.options.max_batch_size)
        cols = {"path": [str(p) for p in batch["path"]], "row_hash": np.asarray(batch["row_hash"], dtype=np.uint64),
                **decoded_columns(results, score=self.score, nbest=self.nbest)}
        return pa.table(cols, schema=self.schema)
