"""`compile = "auto"`: whether a slot loop compiles its step for a call (`compiles`), and the line that says
why. The rule: an fp32 verifier on a CPU compiles where the call saves more than its programs cost. It
saves (eager - compiled) seconds a request as this machine measured that method, model and options
(`record`), else the method's `compile_saves_s` a sentence at batch size 1. It costs nothing where this
process compiled that loop already, else what loading its stored programs took here (COMPILE_WARM_S
until measured), or building them where the store lacks them (COMPILE_COLD_S until measured).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from aggdec import step_store
from aggdec.decoding.compiled_step import refused
from aggdec.decoding.context import DraftContext
from aggdec.decoding.method_options import to_mapping
from aggdec.decoding.options import DecodeOptions
from aggdec.thresholds import COMPILE_COLD_S, COMPILE_WARM_S, RATE_REQUESTS


def compiles(context: DraftContext, opts: DecodeOptions, requests: int) -> tuple[bool, str | None]:
    """Whether a loop of `opts` decoding `requests` requests in one call compiles its step, and under
    `compile = "auto"` why, as a line (else None). `auto` decodes eagerly, quietly, where it does not apply
    (`auto_applies`)."""
    setting = getattr(opts, "compile", False)
    if setting is False or next(context.model.parameters()).device.type != "cpu":
        return False, None
    if setting is True:
        return True, None
    if not auto_applies(context, opts):
        return False, None
    if why := refused(context.model):
        return False, f"eager ({why})"
    key = steps_key(context, opts)
    kept = context.slot_loops.get((opts, 0))
    pays, why = compile_pays(opts, requests, compiled=kept is not None and bool(kept.compiled and kept.compiled.programs),
                             stored=lambda: step_store.stored(key), measured=lambda: step_store.rates(key))
    return (True, f"compiling the {opts.method} step ({why})") if pays else (False, f"eager ({opts.method}, {why})")


def auto_applies(context: DraftContext, opts: DecodeOptions) -> bool:
    """Whether `compile = "auto"` may compile a loop of `opts` on `context`'s verifier: an fp32 verifier on a
    CPU at fp32 precision, below the method's `auto_below` batch size, for a method measured faster, not
    through the invariant kernels (`invariant = true`)."""
    weight = next(context.model.parameters())
    below = getattr(opts, "auto_below", None)
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and opts.precision == "fp32"
            and getattr(opts, "invariant", False) is not True
            and getattr(opts, "compile_saves_s", 0.0) > 0 and (below is None or opts.max_batch_size < below))


def compile_pays(opts: DecodeOptions, requests: int, *, compiled: bool, stored: Callable[[], bool],
                 measured: Callable[[], dict[str, float]] = dict) -> tuple[bool, str]:
    """Whether `compile = "auto"` compiles a call of `requests` requests under `opts`, and why (the module
    docstring's rule): `measured()` holds this machine's seconds a request ("eager", "compiled", from calls
    of at least RATE_REQUESTS requests) and a loop's programs' seconds ("build", "load"); `stored()` says
    whether the store holds the programs (asked only where that decides)."""
    batch = opts.max_batch_size
    call = f"{requests:,} request{'' if requests == 1 else 's'} at batch size {batch}"
    if compiled:
        return True, f"{call}: compiled in this process already"
    rate = measured()
    if "eager" in rate and "compiled" in rate and requests >= RATE_REQUESTS:
        saved = (rate["eager"] - rate["compiled"]) * requests
        call += f", measured here {1 / rate['eager']:.0f} requests/s eager, {1 / rate['compiled']:.0f} compiled"
    else:
        saved = opts.compile_saves_s * requests / max(1, min(batch, requests))
    cold, warm = rate.get("build", COMPILE_COLD_S), rate.get("load", COMPILE_WARM_S)
    if saved <= 0:
        return False, f"{call}: the compiled step measured no faster here"
    if saved < warm:
        return False, f"{call}: would save about {saved:.2g} s, loading the stored step takes about {warm:.2g} s"
    if saved >= cold:
        return True, f"{call}: saves about {saved:.0f} s, building the step takes about {cold:.2g} s"
    if stored():
        return True, f"{call}, stored: saves about {saved:.2g} s, loading takes about {warm:.2g} s"
    return False, f"{call}, not stored: would save about {saved:.0f} s, building takes about {cold:.2g} s"


def steps_key(context: DraftContext, opts: DecodeOptions) -> str:
    """The key of what this machine measured for loops of `opts` on `context`'s verifier: every option but
    `compile`, the prompt, the model's configuration and shapes (not its weights' values) and the thread
    count."""
    model = context.model
    settings = sorted((k, v) for k, v in to_mapping(opts).items() if k != "compile")
    shapes = [(n, tuple(t.shape), str(t.dtype)) for n, t in model.named_parameters()]
    what = (settings, context.prompt, repr(model.cfg), shapes, torch.get_num_threads())
    return hashlib.sha256(repr(what).encode()).hexdigest()


def record(context: DraftContext, opts: DecodeOptions, loop, requests: int, seconds: float, spent: float) -> None:
    """Record what a call of `requests` requests by `loop` measured, where `auto` may compile such a loop:
    the `seconds` a request took by its backend (programs' build or load left out), where the call decoded
    at least RATE_REQUESTS requests and a batch; and where the call `spent` seconds building or loading
    programs, that time and which packages hold them."""
    if not auto_applies(context, opts):
        return
    key, step = steps_key(context, opts), loop.compiled
    if requests >= max(RATE_REQUESTS, opts.max_batch_size):
        step_store.record_rate(key, "compiled" if loop.compile else "eager", seconds / requests)
    if spent and step is not None:
        step_store.record_rate(key, "build" if step.built else "load", spent)
        step_store.record_packages(key, step.keys)


@contextmanager
def measured(context: DraftContext, opts: DecodeOptions, loop, requests: int) -> Iterator[None]:
    """Around a slot `loop` of `opts` decoding a call of `requests` requests: `record` what it took."""
    start = time.perf_counter()
    spent = loop.compiled.seconds if loop.compiled is not None else 0.0
    yield
    spent = (loop.compiled.seconds if loop.compiled is not None else 0.0) - spent
    record(context, opts, loop, requests, time.perf_counter() - start - spent, spent)


_SAID: set = set()  # say_once


def say_once(key: Any, line: str) -> None:
    """Log `line` (INFO, logger "aggdec"; `aggdec decode` prints it on stderr) the first time this
    process sees `key`."""
    if key not in _SAID:
        _SAID.add(key)
        logging.getLogger("aggdec").info(line)


def choose(context: DraftContext, opts: DecodeOptions, requests: int) -> bool:
    """`compiles`'s choice, its line said once a process for each (method, batch size, choice)."""
    compile, line = compiles(context, opts, requests)
    if line:
        say_once((opts.method, opts.max_batch_size, compile), f"aggdec: compile=auto: {line}")
    return compile


def backend(loop) -> str:
    """What ran a slot loop's steps: "compiled", "CUDA graphs" or "eager" (also after a compile that
    failed, which decodes eagerly)."""
    return "compiled" if loop.compile else "CUDA graphs" if loop.graphs is True else "eager"
