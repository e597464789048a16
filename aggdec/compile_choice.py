"""`compile = "auto"`: whether a slot loop compiles its step for a call (`compiles`), by what compiled
decoding measured against eager (on this machine where `record` recorded both, else aggdec.thresholds) and
what compiling costs, and the line that says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from aggdec import compile_cache
from aggdec.decoding.method_options import to_mapping
from aggdec.decoding.options import DecodeOptions
from aggdec.thresholds import COMPILE_COLD_S, COMPILE_WARM_S, RATE_REQUESTS

if TYPE_CHECKING:
    from aggdec.decoding.methods import DraftContext


def compiles(context: DraftContext, opts: DecodeOptions, requests: int) -> tuple[bool | str, str | None]:
    """What a loop of `opts` decoding `requests` requests in one call compiles (SlotLoop's `compile`), and
    under `compile = "auto"` why, as a line (else None). On a CPU, `compile = true` compiles the whole step
    ("step") or, from the method's `whole_step_below` batch size, the model's call within eager steps
    ("model"); "auto" does the same where `compile_pays` says so, for an fp32 verifier and at ATen's own
    ISA (`compile_cache.lowered_isa`), else decodes eagerly (False): quietly where the verifier is not fp32
    or not on a CPU, where compiling does not apply."""
    setting = getattr(opts, "compile", False)
    if setting is False or next(context.model.parameters()).device.type != "cpu":
        return False, None
    below = opts.whole_step_below
    mode = "model" if below is not None and opts.max_batch_size >= below else "step"
    if setting is True:
        return mode, None
    if not auto_applies(context, opts):
        return False, None
    if lowered := compile_cache.lowered_isa():
        return False, f"eager ({lowered}, where a compiled step decodes wrongly)"
    kept = context.slot_loops.get((opts, mode, 0))
    pays, why = compile_pays(opts, requests, compiled=kept is not None and bool(kept.compile),
                             stored=lambda: compile_cache.warm(steps_key(context, opts, mode)),
                             measured=lambda: compile_cache.rates(steps_key(context, opts, mode)))
    what = f"compiling the {opts.method} {'step' if mode == 'step' else 'model call'}"
    return (mode, f"{what} ({why})") if pays else (False, f"eager ({opts.method}, {why})")


def auto_applies(context: DraftContext, opts: DecodeOptions) -> bool:
    """Whether `compile = "auto"` may compile a loop of `opts` on `context`'s verifier: an fp32 verifier on a
    CPU at fp32 precision."""
    weight = next(context.model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and opts.precision == "fp32"


def compile_pays(opts: DecodeOptions, requests: int, *, compiled: bool, stored: Callable[[], bool],
                 measured: Callable[[], dict[str, float]] = dict) -> tuple[bool, str]:
    """Whether `compile = "auto"` compiles a call of `requests` requests under `opts` (a CompiledStep's), and
    why. Only where the whole step compiles (below the method's `whole_step_below` batch size) and measured
    faster (`compile_saves_s`), and where what it saves repays what compiling costs. It saves, a request,
    what `measured()` says for calls of at least RATE_REQUESTS requests where it holds both backends'
    seconds a request on this machine (compile_cache.rates, recorded by `record`; a shorter call then
    imports no TorchInductor, which finding the store does: 1.5 s), else `compile_saves_s` / min(batch
    size, requests) (seconds saved a sentence at batch size 1, measured on one CPU: a compiled step saves
    about a fixed time a verifier call, aggdec.thresholds.GREEDY_COMPILE_SAVES_S). It costs nothing where
    the kept loop of these options is `compiled` already, COMPILE_WARM_S where `stored()` (the store holds
    its programs; asked only where that decides), else COMPILE_COLD_S: each as measured here where
    `measured()` holds it."""
    batch, saves_s = opts.max_batch_size, opts.compile_saves_s
    if not saves_s or (opts.whole_step_below is not None and batch >= opts.whole_step_below):
        return False, f"batch size {batch}: compiled measured no faster" if saves_s else "compiled not measured faster"
    call = f"{requests:,} request{'' if requests == 1 else 's'} at batch size {batch}"
    if compiled:
        return True, f"{call}: compiled in this process already"
    rate = measured() if requests >= RATE_REQUESTS else {}
    if "eager" in rate and "compiled" in rate:
        saved = (rate["eager"] - rate["compiled"]) * requests
        call += f", measured here {1 / rate['eager']:.0f} requests/s eager, {1 / rate['compiled']:.0f} compiled"
    else:
        saved = saves_s * requests / max(1, min(batch, requests))
    cold, warm = rate.get("build", COMPILE_COLD_S), rate.get("load", COMPILE_WARM_S)
    if saved < warm:
        return False, f"{call}: would save about {saved:.2g} s, loading a stored step takes about {warm:.2g} s"
    if saved >= cold:
        return True, f"{call}: saves about {saved:.0f} s, compiling takes about {cold:.2g} s"
    if stored():
        return True, f"{call}, stored: saves about {saved:.0f} s, loading takes about {warm:.2g} s"
    return False, f"{call}, not stored: would save about {saved:.0f} s, compiling takes about {cold:.2g} s"


def record(context: DraftContext, opts: DecodeOptions, compile: bool | str, requests: int, seconds: float,
           compiling: float = 0.0, built: bool = False) -> None:
    """Record what a call of `requests` requests measured, for `compile_pays`: the seconds a request took
    (`seconds` of decoding, compiling left out), eagerly (`compile` False) or by a compiled step, where the
    call decoded at least RATE_REQUESTS requests and a batch; and where a new loop compiled its step, the
    seconds that took (`compiling`), as "build" where it `built` a program, else as "load". Only where
    `compile = "auto"` may compile this loop's step: an fp32 CPU verifier, a method measured faster
    compiled, below its `whole_step_below`."""
    if compile not in (False, "step") or not getattr(opts, "compile_saves_s", 0.0):  # (methods that never compile)
        return
    below = opts.whole_step_below
    if (below is not None and opts.max_batch_size >= below) or not auto_applies(context, opts):
        return
    key = steps_key(context, opts, "step")
    if requests >= max(RATE_REQUESTS, opts.max_batch_size):
        compile_cache.record_rate(key, "compiled" if compile else "eager", seconds / requests)
    if compiling:
        compile_cache.record_rate(key, "build" if built else "load", compiling)


@contextmanager
def measured(context: DraftContext, opts: DecodeOptions, loop, requests: int, new: bool) -> Iterator[None]:
    """Around a slot `loop` of `opts` decoding a call of `requests` requests: `record` what it took, and
    where the loop is `new` and decoded compiled (not a failed compile's eager loop), mark its programs
    stored."""
    start, compiling = time.perf_counter(), compile_cache.compile_seconds()
    built = loop.compile and compile_cache.steps_built()
    yield
    compiling = compile_cache.compile_seconds() - compiling
    new = new and bool(loop.compile)
    record(context, opts, loop.compile, requests, time.perf_counter() - start - compiling, compiling if new else 0.0,
           new and compile_cache.steps_built() > built)
    if new:
        mark_stored(context, opts, loop.compile)


def steps_key(context: DraftContext, opts: DecodeOptions, mode: str) -> str:
    """`compile_cache.steps_key` of a loop of `opts` compiling `mode` on `context`'s verifier at the current
    thread count, computed once a context: every option but `compile` (more than the programs depend on:
    options that differ in any miss each other's marker rather than find programs of another loop), the
    prompt."""
    at = (opts, mode, torch.get_num_threads())
    if at not in context.steps_keys:
        settings = sorted((k, v) for k, v in to_mapping(opts).items() if k != "compile")
        context.steps_keys[at] = compile_cache.steps_key(context.model, repr((settings, mode, context.prompt)))
    return context.steps_keys[at]


_SAID: set = set()  # say_once


def say_once(key: Any, line: str) -> None:
    """Log `line` (INFO, logger "aggdec"; `aggdec decode` prints it on stderr) the first time this
    process sees `key`."""
    if key not in _SAID:
        _SAID.add(key)
        logging.getLogger("aggdec").info(line)


def choose(context: DraftContext, opts: DecodeOptions, requests: int) -> bool | str:
    """`compiles`'s choice, its line said once a process for each (method, batch size, choice)."""
    compile, line = compiles(context, opts, requests)
    if line:
        say_once((opts.method, opts.max_batch_size, compile), f"aggdec: compile=auto: {line}")
    return compile


def mark_stored(context: DraftContext, opts: DecodeOptions, mode: str) -> None:
    """Mark the store as holding the programs of a loop of `opts` that decoded compiling `mode`."""
    compile_cache.mark_warm(steps_key(context, opts, mode))


def backend(loop) -> str:
    """What ran a slot loop's steps: "compiled step", "compiled model call", "CUDA graphs" or "eager" (also
    after a compile that failed, which decodes eagerly)."""
    compiled = {"step": "compiled step", "model": "compiled model call"}.get(loop.compile)
    return compiled or ("CUDA graphs" if loop.graphs is True else "eager")
