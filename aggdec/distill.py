"""Seq-KD data: which decoded pairs are training data, and the training TSV.

The one filter of the project, used by distill jobs (every row stays in their Parquet output, with
`kept` (bool) and `filter_reason` ("" when kept)) and by `python -m aggdec.train.seqkd`. The first
filter that applies is the reason:

  error           status "error" (always)
  truncated       status "truncated": the output covers only the source's first tokens (always)
  truncated_output, unknown_tokens, invalid_utf8, invalid_output
                  the row statuses of the same names (always: a cut output, a source the model
                  cannot represent, input bytes that were not text, output bytes that are not)
  empty           status "empty", or an output that is empty or only whitespace (drop_empty)
  control_chars   the output holds a control character (tab, CR, LF, ...; always, see the TSV below)
  len_ratio_low   hyp_len / (src_len - 1) < min_len_ratio
  len_ratio_high  hyp_len / (src_len - 1) > max_len_ratio
                  (token counts without eos, the source's by the source tokenizer; rows without
                  source tokens have no ratio and pass both)

TSV: UTF-8, header `src<TAB>kd`, then one `<src><TAB><hyp>` line per kept row in input
order, no quoting and no escaping: `aggdec.train.ar.read_tsv` (what `python -m aggdec.train.heads
--data` uses) splits on tabs and newlines with csv.QUOTE_NONE and has no unescaping. So nothing is
escaped: the source written is `clean_text(src)`, the text the verifier actually decoded, in which
every control character is already a space; an output holding a control character is filtered
(`control_chars`) rather than altered. The TSV holds the 1-best only; the n-best are in Parquet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from aggdec.text import clean_text

REASONS = ("error", "truncated", "truncated_output", "unknown_tokens", "invalid_utf8", "invalid_output", "empty",
           "control_chars", "len_ratio_low", "len_ratio_high")
REASON_TEXT = {"error": "failed to decode", "truncated": "with sources cut to the model's positions",
               "truncated_output": "cut at the output length limit", "unknown_tokens": "mostly unknown tokens",
               "invalid_utf8": "not valid UTF-8", "invalid_output": "with outputs that are not valid UTF-8",
               "empty": "empty", "control_chars": "with control characters",
               "len_ratio_low": "below the length ratio", "len_ratio_high": "above the length ratio"}
"""Each of `REASONS` in words, for messages."""
TSV_HEADER = "src\tkd\n"
_CONTROL = r"[\x00-\x1f\x7f-\x{9f}]"  # Unicode category Cc, what clean_text replaces


@dataclass
class PairFilter:
    """Which decoded pairs are kept as training data (errors, truncated sources and outputs with
    control characters never are)."""

    min_len_ratio: float | None = None
    """Drop pairs whose hyp/src token-length ratio (both without eos) is below this (None: no limit)."""
    max_len_ratio: float | None = None
    """Drop pairs whose hyp/src token-length ratio is above this (None: no limit)."""
    drop_empty: bool = True
    """Drop pairs with an empty source or output."""


def filter_reasons(table: pa.Table, opts: PairFilter) -> np.ndarray:
    """The filter_reason of every row of `table` (columns status, hyp, src_len, hyp_len): "" if kept."""
    status = np.asarray(table.column("status").to_pylist(), dtype=object)
    hyp = table.column("hyp")
    blank = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(hyp), ""), True).to_numpy(zero_copy_only=False)
    control = pc.fill_null(pc.match_substring_regex(hyp, _CONTROL), False).to_numpy(zero_copy_only=False)
    src_tokens = table.column("src_len").to_numpy(zero_copy_only=False).astype(np.float64) - 1
    hyp_tokens = table.column("hyp_len").to_numpy(zero_copy_only=False).astype(np.float64)
    has_ratio = src_tokens > 0
    ratio = np.divide(hyp_tokens, src_tokens, out=np.zeros_like(hyp_tokens), where=has_ratio)
    low = has_ratio & (ratio < opts.min_len_ratio) if opts.min_len_ratio is not None else np.zeros(len(status), bool)
    high = has_ratio & (ratio > opts.max_len_ratio) if opts.max_len_ratio is not None else np.zeros(len(status), bool)
    empty = ((status == "empty") | blank) if opts.drop_empty else np.zeros(len(status), bool)
    conditions = [status == "error", status == "truncated", status == "truncated_output", status == "unknown_tokens",
                  status == "invalid_utf8", status == "invalid_output", empty, control, low, high]
    return np.select(conditions, list(REASONS), default="").astype(object)


def distill_table(table: pa.Table, opts: PairFilter, *, tsv: bool = True) -> tuple[pa.Table, bytes | None, dict]:
    """Add `kept` and `filter_reason` to a decoded table (columns src, hyp, status, src_len, hyp_len);
    -> (table, the TSV of the kept pairs (None when `tsv` is False), counts).

    counts: {"kept": n, "filtered": {reason: n}} with only the reasons that occurred, in REASONS order.
    """
    reasons = filter_reasons(table, opts)
    kept = reasons == ""
    table = table.append_column("kept", pa.array(kept, pa.bool_()))
    table = table.append_column("filter_reason", pa.array(reasons.tolist(), pa.string()))
    filtered = {r: int((reasons == r).sum()) for r in REASONS}
    counts = {"kept": int(kept.sum()), "filtered": {r: n for r, n in filtered.items() if n}}
    return table, (TSV_HEADER.encode("utf-8") + pair_lines(table, kept)) if tsv else None, counts


def pair_lines(table: pa.Table, kept: np.ndarray) -> bytes:
    """The TSV lines (no header) of the rows of `table` where `kept` (bool array) holds."""
    rows = np.flatnonzero(kept)
    src = table.column("src").take(rows).to_pylist()
    hyp = table.column("hyp").take(rows).to_pylist()
    return "".join(f"{clean_text(s)}\t{h}\n" for s, h in zip(src, hyp)).encode("utf-8")


def merge_counts(counts: list[dict]) -> dict:
    """Sum distill_table counts over shards."""
    filtered: dict[str, int] = {}
    for c in counts:
        for r, n in c["filtered"].items():
            filtered[r] = filtered.get(r, 0) + n
    return {"kept": sum(c["kept"] for c in counts),
            "filtered": {r: filtered[r] for r in REASONS if r in filtered}}
