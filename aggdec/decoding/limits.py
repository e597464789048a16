"""Output length limits, shared by every decoding method."""

from __future__ import annotations


def max_len_for(src_len: int, max_len_a: float, max_len_b: int, max_target_positions: int) -> int:
    """fairseq-generate's output limit, min(int(a * src_len + b), max_target_positions - 1): the most
    tokens generated before eos is forced. `src_len` counts the source's final eos (fairseq's source
    width, which at batch size 1 is the sentence's length including eos)."""
    return min(int(max_len_a * src_len + max_len_b), max_target_positions - 1)
