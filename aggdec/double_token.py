"""Double-token bidirectional decoding: the token order of a model that emits a pair per step.

Such a model (ModelConfig.double_token) generates, at each decoder step, one token from the head and
one from the tail of the sentence ("Transformer-based Double-token Bidirectional Autoregressive
Decoding in Neural Machine Translation"). Its decoder sees the *folded* sequence

    y_1 .. y_n  ->  L_1 R_1 L_2 R_2 ...  =  y_1 y_n y_2 y_(n-1) ...

(left half, reversed right half, alternately folded), closed by one or two end-of-decoding tokens
(the vocabulary's eos) so that the length is even. Decoding starts from the pair (bos, decoder
start) and stops at the first pair holding an end-of-decoding token; `unfold` turns the pairs back
into a sentence. The self-attention unit is a pair: both positions of pair t see every position of
pairs <= t (`pair_limit`), so a pair's two tokens are predicted together from the pairs before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

STRIDE = 2
"""Tokens per decoder step of a double-token model."""


def fold(tokens: Sequence[int], eod: int) -> list[int]:
    """The folded target of a sentence: [y_1, y_n, y_2, y_(n-1), ...] + one or two `eod` (even length).

    An odd-length sentence puts its middle token in the last pair's left slot, next to one `eod`;
    an even-length one ends with the pair (eod, eod).
    """
    n = len(tokens)
    left, right = tokens[: (n + 1) // 2], tokens[(n + 1) // 2:][::-1]
    out: list[int] = []
    for i, tok in enumerate(left):
        out.append(tok)
        if i < len(right):
            out.append(right[i])
    out.append(eod)
    if len(out) % 2:
        out.append(eod)
    return out


def unfold(stream: Sequence[int], eod: int) -> list[int]:
    """The sentence of a folded stream, read up to its first pair that holds `eod`.

    Left tokens in order, then right tokens reversed. In the closing pair a left token before an
    `eod` is the middle token; a right token after a left `eod` is dropped. A stream with no `eod`
    (cut short) is unfolded as far as it goes.
    """
    left: list[int] = []
    right: list[int] = []
    for t in range(0, len(stream) - len(stream) % STRIDE, STRIDE):
        a, b = stream[t], stream[t + 1]
        if a == eod:
            break
        if b == eod:
            left.append(a)
            break
        left.append(a)
        right.append(b)
    return left + right[::-1]


def teacher_forcing(tokens: Sequence[int], bos: int, start: int, eod: int) -> tuple[list[int], list[int]]:
    """(decoder input, target) of a sentence for a double-token model: the target is its folded
    stream, the input the start pair (bos, start) then the stream without its last pair."""
    target = fold(tokens, eod)
    return [bos, start, *target[:-STRIDE]], target


def pair_limit(pos: torch.Tensor) -> torch.Tensor:
    """The last key position each query position may attend to: the end of its own pair (pos | 1)."""
    return pos | 1
