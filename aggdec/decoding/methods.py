"""The method registry, the one place that wires decoding methods together (docs/design.md, "Options
and the method registry"). A method is an options class (aggdec.decoding.method_options) plus a
function that builds its drafter for the draft -> verify loop, or, for a method outside the loop, one
that decodes; `register` adds both sides.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from aggdec import compile_cache
from aggdec.decoding.acceptance import ExactMatch
from aggdec.decoding.beam import run_beam
from aggdec.decoding.blockwise import BlockwiseHeads
from aggdec.decoding.budget import DraftBudget
from aggdec.decoding.drafters import Drafter, NoDraft
from aggdec.decoding.gad_head import DraftHeadDrafter
from aggdec.decoding.iad import InputCopy
from aggdec.decoding.metadata import Hypothesis, Request
from aggdec.decoding.method_options import (OPTIONS, BeamOptions, BlockwiseOptions, GADOptions, GADPlusOptions,
                                            GreedyOptions, IADOptions, to_mapping)
from aggdec.decoding.options import DecodeOptions, OptionError
from aggdec.decoding.slot_loop import SlotLoop
from aggdec.decoding.streams import decode_in_streams, stream_count
from aggdec.model.projection import OutputProjection
from aggdec.model.transformer import Transformer
from aggdec.threads import THREADS
from aggdec.thresholds import COMPILE_COLD_S, COMPILE_WARM_S, DRAFT_LONGEST, KEPT_BUDGETS, KEPT_BUFFERS, KEPT_LOOPS


@dataclass
class DraftContext:
    """What building a drafter may use: the verifier, its output projection, whether drafts may run in
    bf16 (`drafts_in_bf16`), and `load(path, bf16)`, which loads a drafter directory for this verifier.
    `prompt`: the decoder start and forced first tokens (aggdec.conventions.Framing; None: eos only).
    `backends`: requests decoded by each backend (`SlotLoop.backend`; beam: "eager"), counted by `decode`."""

    model: Transformer
    projection: OutputProjection
    bf16: bool
    load: Callable[[str, bool], Any]
    budgets: dict = field(default_factory=dict)  # DraftBudgets by (options, compile, stream), kept across runs
    prompt: tuple[int, ...] | None = None
    slot_loops: dict = field(default_factory=dict)  # SlotLoops by (options, compile, stream), kept (KEPT_LOOPS)
    backends: Counter = field(default_factory=Counter)


@dataclass(frozen=True)
class Method:
    """A registered decoding method: drafter(options, context) builds its drafter for the draft ->
    verify loop; None for a method outside the loop, which `run(options, model, requests, prompt)` decodes."""

    options: type[DecodeOptions]
    drafter: Callable[[Any, DraftContext], Drafter] | None = field(default=None)
    run: Callable[..., list[Hypothesis]] | None = field(default=None)

    @property
    def name(self) -> str:
        return self.options.method

    def lossless(self, opts: DecodeOptions) -> bool:
        """Greedy's output token for token: a draft -> verify method with exact top-1 acceptance."""
        return self.drafter is not None and isinstance(opts.acceptance(), ExactMatch)

    def loop(self, opts: DecodeOptions, context: DraftContext, drafter: Drafter, stream: int = 0,
             compile: bool | str | None = None) -> SlotLoop:
        """The draft -> verify loop of `opts` around `drafter` compiling `compile` (SlotLoop's; None: what
        `compiles` picks for one request), kept across runs with its compiled step, buffers and captured
        steps, with a draft budget where `opts` asks for `draft_length = "auto"` and the drafter drafts;
        `stream`: which of a call's decoding streams it runs (each keeps a budget of its own). Loops and
        budgets are kept by (options, compile, stream)."""
        if compile is None:
            compile = compiles(context, opts, 1)[0]
        key = (opts, compile, stream)
        budget = None
        if getattr(opts, "draft_length", "max") == "auto" and getattr(drafter, "max_draft", 0) != 0:
            budget = _keep(context.budgets, key, KEPT_BUDGETS, lambda: DraftBudget(drafter.max_draft or DRAFT_LONGEST))
        loop = _keep(context.slot_loops, key, KEPT_LOOPS, lambda: SlotLoop(
            context.model, drafter, opts.acceptance(), max_batch_size=opts.max_batch_size, max_tokens=opts.max_tokens,
            budget=budget, prompt=context.prompt, compile=compile, projection=context.projection))
        recent = list(dict.fromkeys(k[:2] for k in reversed(context.slot_loops)))[:KEPT_BUFFERS]
        for other, kept in context.slot_loops.items():
            if other[:2] not in recent:
                kept.release()
        loop.budget = budget
        return loop

    def decode(self, opts: DecodeOptions, requests: list[Request], context: DraftContext) -> list[Hypothesis]:
        """Hypotheses of `requests`, in completion order: on a CPU's eager path, where other processes
        hold the cores and the batch is wide enough, in several streams (aggdec.decoding.streams),
        else one loop; compiled as `compiles` picks for this many requests (under `compile = "auto"`
        it says each distinct choice once a process, `say_once`). Counts the requests in
        `context.backends`; where a new loop (not streams) decoded compiled, marks its programs stored
        (`compile_cache.mark_warm`)."""
        if self.drafter is None:
            context.backends["eager"] += len(requests)
            return self.run(opts, context.model, requests, context.prompt)
        compile, line = compiles(context, opts, len(requests))
        if line:
            say_once((opts.method, opts.max_batch_size, compile), f"aggdec: compile=auto: {line}")
        new = (opts, compile, 0) not in context.slot_loops
        loop = self.loop(opts, context, self.drafter(opts, context), compile=compile)
        cpu = loop.device.type == "cpu" and loop.packed
        n = stream_count(THREADS.own_threads(), opts.max_batch_size, len(requests)) if cpu else 1
        if n == 1 or not THREADS.cores_busy():
            hyps = list(loop.run(requests))
            if new and loop.compile:  # (not a failed compile's eager loop)
                compile_cache.mark_warm(_steps_key(context, opts, loop.compile))
        else:
            part = dataclasses.replace(opts, max_batch_size=opts.max_batch_size // n,
                                       max_tokens=opts.max_tokens and max(1, opts.max_tokens // n))
            loops = [self.loop(part, context, self.drafter(part, context), k, compile).run for k in range(n)]
            hyps = decode_in_streams(loops, requests)
        context.backends[loop.backend] += len(requests)
        return hyps


def _keep(kept: dict, key: Any, most: int, new: Callable[[], Any]) -> Any:
    """`kept[key]` (made by `new()` where missing), moved to the end as the most recently used; the
    oldest beyond `most` entries go."""
    kept[key] = kept.pop(key) if key in kept else new()
    while len(kept) > most:
        kept.pop(next(iter(kept)))
    return kept[key]


def compiles(context: DraftContext, opts: DecodeOptions, requests: int) -> tuple[bool | str, str | None]:
    """What a loop of `opts` decoding `requests` requests in one call compiles (SlotLoop's `compile`), and
    under `compile = "auto"` why, as a line (else None). On a CPU, `compile = true` compiles the whole step
    ("step") or, from the method's `whole_step_below` batch size, the model's call within eager steps
    ("model"); "auto" does the same where `compile_pays` says so, for an fp32 verifier and at ATen's own
    ISA (`compile_cache.lowered_isa`), else decodes eagerly (False): quietly where the verifier is not fp32
    or not on a CPU, where compiling does not apply."""
    setting = getattr(opts, "compile", False)
    weight = next(context.model.parameters())
    if setting is False or weight.device.type != "cpu":
        return False, None
    below = opts.whole_step_below
    mode = "model" if below is not None and opts.max_batch_size >= below else "step"
    if setting is True:
        return mode, None
    if opts.precision != "fp32" or weight.dtype != torch.float32:
        return False, None
    if lowered := compile_cache.lowered_isa():
        return False, f"eager ({lowered}, where a compiled step decodes wrongly)"
    kept = context.slot_loops.get((opts, mode, 0))
    pays, why = compile_pays(opts, requests, compiled=kept is not None and bool(kept.compile),
                             stored=lambda: compile_cache.warm(_steps_key(context, opts, mode)))
    what = f"compiling the {opts.method} {'step' if mode == 'step' else 'model call'}"
    return (mode, f"{what} ({why})") if pays else (False, f"eager ({opts.method}, {why})")


def compile_pays(opts: DecodeOptions, requests: int, *, compiled: bool, stored: Callable[[], bool]) -> tuple[bool, str]:
    """Whether `compile = "auto"` compiles a call of `requests` requests under `opts` (a CompiledStep's), and
    why. Only below the method's `compile_pays_below` batch size, where compiled decoding measured faster;
    there where what it saves repays what compiling costs: `compile_saves_s` a sentence at batch size 1, so
    `compile_saves_s` x requests / min(batch size, requests) seconds (a compiled step saves about a fixed
    time a verifier call, aggdec.thresholds.GREEDY_COMPILE_SAVES_S), against nothing where the kept loop
    of these options is `compiled` already, COMPILE_WARM_S where `stored()` (the store holds its
    programs; asked only where that decides), else COMPILE_COLD_S."""
    batch, saves_s = opts.max_batch_size, opts.compile_saves_s
    if not saves_s or (opts.compile_pays_below is not None and batch >= opts.compile_pays_below):
        return False, f"batch size {batch}: compiled measured no faster" if saves_s else "compiled not measured faster"
    saved = saves_s * requests / max(1, min(batch, requests))
    call = f"{requests:,} request{'' if requests == 1 else 's'} at batch size {batch}"
    if compiled:
        return True, f"{call}: compiled in this process already"
    if saved < COMPILE_WARM_S:
        return False, f"{call}: would save about {saved:.2g} s, loading a stored step takes about {COMPILE_WARM_S:g} s"
    if saved >= COMPILE_COLD_S:
        return True, f"{call}: saves about {saved:.0f} s, compiling takes about {COMPILE_COLD_S:g} s"
    if stored():
        return True, f"{call}, stored: saves about {saved:.0f} s, loading takes about {COMPILE_WARM_S:g} s"
    return False, f"{call}, not stored: would save about {saved:.0f} s, compiling takes about {COMPILE_COLD_S:g} s"


def _steps_key(context: DraftContext, opts: DecodeOptions, mode: str) -> str:
    """`compile_cache.steps_key` of a loop of `opts` compiling `mode` on `context`'s verifier: every option
    but `compile` (more than the programs depend on: options that differ in any miss each other's marker
    rather than find programs of another loop), the prompt."""
    settings = {k: v for k, v in to_mapping(opts).items() if k != "compile"}
    return compile_cache.steps_key(context.model, repr((sorted(settings.items()), mode, context.prompt)))


_SAID: set = set()  # say_once


def say_once(key: Any, line: str) -> None:
    """Log `line` (INFO, logger "aggdec"; `aggdec decode` prints it on stderr) the first time this
    process sees `key`."""
    if key not in _SAID:
        _SAID.add(key)
        logging.getLogger("aggdec").info(line)


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add (or replace) a method under its options class's `method` name, its options class with it
    (method_options.OPTIONS)."""
    METHODS[method.name] = method
    OPTIONS[method.name] = method.options
    return method


def unregister(name: str) -> None:
    """Remove a registered method and its options class."""
    METHODS.pop(name, None)
    OPTIONS.pop(name, None)


register(Method(GreedyOptions, lambda opts, ctx: NoDraft()))
register(Method(BeamOptions, run=run_beam))
register(Method(IADOptions, InputCopy.from_options))
register(Method(GADOptions, DraftHeadDrafter.from_options))
register(Method(GADPlusOptions, DraftHeadDrafter.from_options))
register(Method(BlockwiseOptions, BlockwiseHeads.from_options))


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise OptionError("method", f"must be one of {', '.join(METHODS)}; got {name!r}")
    return METHODS[name]


def drafts_in_bf16(opts: DecodeOptions, projection: OutputProjection) -> bool:
    """bf16 drafts cannot change a lossless method's output; lossy methods keep fp32 drafters so that
    no output depends on the verify precision."""
    return projection.certify and get_method(opts.method).lossless(opts)
