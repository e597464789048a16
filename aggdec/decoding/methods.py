"""The method registry, the one place that wires decoding methods together (docs/design.md, "Options
and the method registry"). A method is an options class (aggdec.decoding.method_options) plus a
function that builds its drafter for the draft -> verify loop, or, for a method outside the loop, one
that decodes; `register` adds both sides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aggdec.decoding.acceptance import ExactMatch
from aggdec.decoding.beam import beam_search
from aggdec.decoding.blockwise import BlockwiseHeads
from aggdec.decoding.budget import DraftBudget
from aggdec.decoding.compile_choice import backend, choose, compiles, measured, say_once
from aggdec.decoding.context import DraftContext
from aggdec.decoding.drafters import Drafter, NoDraft
from aggdec.decoding.gad_head import DraftHeadDrafter
from aggdec.decoding.iad import InputCopy
from aggdec.decoding.metadata import Hypothesis, Request
from aggdec.decoding.method_options import (OPTIONS, BeamOptions, BlockwiseOptions, GADOptions, GADPlusOptions,
                                            GreedyOptions, IADOptions)
from aggdec.decoding.options import DecodeOptions, OptionError
from aggdec.decoding.pair_beam import pair_beam_search
from aggdec.decoding.slot_loop import SlotLoop
from aggdec.decoding.streams import decode_in_streams, stream_count
from aggdec.model import invariant
from aggdec.model.projection import OutputProjection
from aggdec.model.transformer import Transformer
from aggdec.threads import THREADS
from aggdec.thresholds import DRAFT_LONGEST, KEPT_BUDGETS, KEPT_BUFFERS, KEPT_LOOPS


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
             compile: bool | None = None) -> SlotLoop:
        """The draft -> verify loop of `opts` around `drafter` (made with the first call's), kept across runs
        with its compiled step, buffers and captured steps, its next runs compiling `compile` (None: what
        `compiles` picks for one request) on those same buffers; with a draft budget where `opts` asks for
        `draft_length = "auto"` and the drafter drafts. `stream`: which of a call's decoding streams it runs.
        Loops are kept by (options, stream), budgets by (options, compile, stream)."""
        invariant = invariant_for(opts, context.model, self.lossless(opts))
        if compile is None:
            compile = compiles(context, opts, 1)[0]
        budget = None
        if getattr(opts, "draft_length", "max") == "auto" and getattr(drafter, "max_draft", 0) != 0:
            budget = _keep(context.budgets, (opts, compile, stream), KEPT_BUDGETS,
                           lambda: DraftBudget(drafter.max_draft or DRAFT_LONGEST))
        loop = _keep(context.slot_loops, (opts, stream), KEPT_LOOPS, lambda: SlotLoop(
            context.model, drafter, opts.acceptance(), max_batch_size=opts.max_batch_size, max_tokens=opts.max_tokens,
            prompt=context.prompt, compile=compile, projection=context.projection, invariant=invariant))
        recent = list(context.slot_loops)[-KEPT_BUFFERS:]
        for other, kept in context.slot_loops.items():
            if other not in recent:
                kept.release()
        loop.use_compiled(compile)
        loop.budget = budget
        return loop

    def decode(self, opts: DecodeOptions, requests: list[Request], context: DraftContext) -> list[Hypothesis]:
        """Hypotheses of `requests`, in completion order: on a CPU's eager path, where other processes
        hold the cores and the batch is wide enough, in several streams (aggdec.decoding.streams),
        else one loop; compiled as `compile_choice.choose` picks for this many requests. Counts the
        requests in `context.backends`; where one loop decoded, what it `measured`."""
        if self.drafter is None:
            context.backends["eager"] += len(requests)
            return self.run(opts, context.model, requests, context.prompt)
        compile = choose(context, opts, len(requests))
        loop = self.loop(opts, context, self.drafter(opts, context), compile=compile)
        cpu = loop.device.type == "cpu" and loop.eager
        n = stream_count(THREADS.own_threads(), opts.max_batch_size, len(requests)) if cpu else 1
        if n == 1 or not THREADS.cores_busy():
            with measured(context, opts, loop, len(requests)):
                hyps = list(loop.run(requests))
        else:
            part = dataclasses.replace(opts, max_batch_size=opts.max_batch_size // n,
                                       max_tokens=opts.max_tokens and max(1, opts.max_tokens // n))
            loops = [self.loop(part, context, self.drafter(part, context), k, compile).run for k in range(n)]
            hyps = decode_in_streams(loops, requests)
        context.backends[backend(loop)] += len(requests)
        return hyps


def invariant_for(opts: DecodeOptions, model: Transformer, lossless: bool) -> bool:
    """Whether a loop of `opts` on `model` runs the batch-invariant kernels (aggdec.model.invariant):
    `opts.invariant`, "auto" being on for a `lossless` method on a CUDA device (where they cannot run
    there: off, said once). OptionError where `invariant = true` and they cannot run."""
    setting = getattr(opts, "invariant", False)
    if setting is False:
        return False
    weight = next(model.parameters())
    why = invariant.unavailable(weight.device, weight.dtype)
    if setting is True:
        if why:
            raise OptionError("invariant", why)
        return True
    if weight.device.type != "cuda" or not lossless:
        return False
    if why:
        say_once(("invariant", why), f"aggdec: invariant=auto: off ({why}); lossless outputs may differ from greedy's "
                                     "in near-ties")
    return why is None


def _keep(kept: dict, key: Any, most: int, new: Callable[[], Any]) -> Any:
    """`kept[key]` (made by `new()` where missing), moved to the end as the most recently used; the
    oldest beyond `most` entries go."""
    kept[key] = kept.pop(key) if key in kept else new()
    while len(kept) > most:
        kept.pop(next(iter(kept)))
    return kept[key]


def run_beam(opts: BeamOptions, model: Transformer, requests: list[Request],
             prompt: tuple[int, ...] | None = None) -> list[Hypothesis]:
    """Decode `requests` as `opts` says: beam search, over (head, tail) pairs for a double-token model
    (the double-token paper's Algorithm 1)."""
    search = pair_beam_search if model.cfg.double_token else beam_search
    return search(model, requests, beam=opts.beam, lenpen=opts.lenpen, max_batch_size=opts.max_batch_size,
                  nbest=opts.nbest, prompt=prompt)


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
