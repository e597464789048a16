"""Beam search's candidates: each row's few largest log-probs among beam x vocabulary, found by
searching only the chunks of the row that can hold them (`top_candidates`)."""

from __future__ import annotations

import torch

from aggdec.thresholds import CHUNKED_FROM, CHUNKS


def chunk_for(vocab: int) -> int | None:
    """The chunk length top_candidates uses for rows of whole vocabularies, or None (plain top-k)."""
    return next((c for c in CHUNKS if vocab % c == 0), None)


def top_candidates(flat: torch.Tensor, count: int, chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(flat, count): each row's `count` largest values, largest first, and their columns,
    but for the order among exactly equal values. On the CPU, with `chunk` (dividing the row length),
    only the `count` chunks with the largest maxima are searched: any of the row's `count` largest
    values lies in one of them (a value elsewhere is below `count` chunk maxima)."""
    rows, width = flat.shape
    plain = chunk is None or flat.device.type != "cpu" or width // chunk < 4 * count
    if plain or flat.numel() < CHUNKED_FROM:
        return torch.topk(flat, count)
    n = width // chunk
    chunks = flat.view(rows, n, chunk)
    best = torch.topk(chunks.amax(dim=2), count, sorted=False).indices  # (rows, count)
    picked = chunks.reshape(rows * n, chunk).index_select(
        0, (torch.arange(rows, device=flat.device)[:, None] * n + best).view(-1))
    values, at = torch.topk(picked.view(rows, count * chunk), count)
    return values, best.gather(1, torch.div(at, chunk, rounding_mode="floor")) * chunk + at % chunk
