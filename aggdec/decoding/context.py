"""What building a drafter and choosing a loop's backend may use (`DraftContext`), below the method
registry (aggdec.decoding.methods) that wires them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aggdec.model.projection import OutputProjection
from aggdec.model.transformer import Transformer


@dataclass
class DraftContext:
    """What building a drafter may use: the verifier, its output projection, whether drafts may run in
    bf16 (`drafts_in_bf16`), and `load(path, bf16)`, which loads a drafter directory for this verifier.
    `prompt`: the decoder start and forced first tokens (aggdec.conventions.Framing; None: eos only).
    `backends`: requests decoded by each backend (`compile_choice.backend`; beam: "eager"), counted by `decode`."""

    model: Transformer
    projection: OutputProjection
    bf16: bool
    load: Callable[[str, bool], Any]
    budgets: dict = field(default_factory=dict)  # DraftBudgets by (options, compile, stream), kept across runs
    prompt: tuple[int, ...] | None = None
    slot_loops: dict = field(default_factory=dict)  # SlotLoops by (options, stream), kept (KEPT_LOOPS)
    backends: Counter = field(default_factory=Counter)
