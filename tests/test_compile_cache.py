"""A compiled slot-loop step is compiled once per machine (aggdec.compile_cache): a second process
loads the program the first one stored, without compiling, and decodes as the eager loop does; a
program holds its model's weights, so a model of the same shapes never gets another one's program.
Compiles run in processes of their own, which share a TorchInductor cache directory (`store`)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compiles

from aggdec import compile_cache

REPO = Path(__file__).resolve().parent.parent

DECODE = """
import json, random, sys
import torch
torch.set_num_threads(1)  # the decode keeps it (aggdec.threads): no second program for another thread count
from test_loop import _requests
from tiny_models import tiny_model
from aggdec import compile_cache
from aggdec.decoding.slot_loop import SlotLoop

model = tiny_model("prenorm-learned-separate", seed=int(sys.argv[1]), vocab=9).float()
reqs = _requests(random.Random(7), 8, 9, model.cfg.eos, repeat=True)
eager = {h.index: h.tokens for h in SlotLoop(model, max_batch_size=4).run(reqs)}
loop = SlotLoop(model, max_batch_size=4, compile=True)
compiled = {h.index: h.tokens for h in loop.run(reqs)}
print(json.dumps({"eager": sorted(eager.items()), "equal": compiled == eager, "compiled": loop._compiled is not None,
                  **compile_cache.COUNTS, "dynamo": "torch._dynamo" in sys.modules,
                  "inductor": sorted(sys.modules["torch._dynamo"].utils.counters["inductor"])
                  if "torch._dynamo" in sys.modules else []}))
"""
"""Greedy on 8 requests by a tiny fp32 model of seed argv[1] (Inductor's own C++ products, weights frozen),
eager and compiled: prints the eager tokens, whether the compiled ones equal them, whether the step
stayed compiled, how many programs were built and loaded and how many steps ran a recorded program
(`compile_cache.COUNTS`), whether TorchDynamo was imported, and the Inductor counters that moved (any
lowering moves some)."""


def _env(store: Path) -> dict:
    """The environment of a `DECODE` process on the cache directory `store`, at the CPU's own ISA."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
               TORCHINDUCTOR_CACHE_DIR=str(store))
    env.pop("ATEN_CPU_CAPABILITY", None)
    return env


def _decode(store: Path, seed: int) -> dict:
    done = subprocess.run([sys.executable, "-c", DECODE, str(seed)], env=_env(store), cwd=store, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["compiled"] and result["equal"], (result, done.stderr[-3000:])
    return result


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[Path, dict]:
    """A cache directory where a first process compiled model 5's step, and that process's result."""
    path = tmp_path_factory.mktemp("inductor")
    first = _decode(path, 5)
    assert first["built"] >= 1 and first["inductor"], first
    return path, first


@compiles
def test_a_second_process_loads_the_program_and_compiles_nothing(store):
    """The second process runs every step from the first one's records: it builds nothing, and never
    imports TorchDynamo (no trace, no guards)."""
    path, first = store
    assert first["dynamo"] and first["replayed"] > 0, first  # its own later steps ran the record too
    second = _decode(path, 5)
    assert second["built"] == 0 and second["loaded"] >= 1 and second["inductor"] == [], second
    assert second["replayed"] > 0 and not second["dynamo"], second
    assert second["eager"] == first["eager"]


@compiles
def test_a_model_of_the_same_shapes_gets_a_program_of_its_own(store):
    """Model 6 after model 5, same shapes, same cache: its own program (loading 5's would decode with
    5's weights, frozen into it), which gives its own eager tokens."""
    path, first = store
    other = _decode(path, 6)
    assert other["eager"] != first["eager"]
    assert other["built"] >= 1, other


@compiles
def test_two_processes_compiling_at_once_build_each_program_once(tmp_path, store):
    """Two processes started together on an empty store: each program is built by one of them, under its
    key's lock (the other waits, then loads it): together they build what one process alone builds
    (`store`'s first process), and both decode as the eager loop does."""
    runs = [subprocess.Popen([sys.executable, "-c", DECODE, "5"], env=_env(tmp_path), cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        results.append(json.loads(out.splitlines()[-1]))
    a, b = results
    assert a["compiled"] and a["equal"] and b["compiled"] and b["equal"] and a["eager"] == b["eager"], results
    assert a["built"] + b["built"] == store[1]["built"] and a["loaded"] + b["loaded"] >= store[1]["built"], results


def test_the_key_holds_the_weights_and_the_directory_torch_and_the_cpu(monkeypatch):
    """Graphs equal but for one weight's value have different keys; equal graphs, one key. The
    store's directory names torch's version and the CPU's ISA: another version's programs are elsewhere."""
    def key(weight: float) -> str:
        linear = torch.nn.Linear(3, 2)
        with torch.no_grad():
            linear.weight.fill_(0.5)
            linear.bias.fill_(0.5)
            linear.weight[1, 2] = weight
        gm = torch.fx.symbolic_trace(linear)
        return compile_cache._key(gm, [torch.empty(4, 3)], {"freezing": True})

    assert key(0.5) == key(0.5) != key(0.25)
    here = compile_cache.store_dir()
    assert torch.__version__ in here and torch.backends.cpu.get_cpu_capability() in here
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert compile_cache.store_dir() != here


def _context(model):
    from aggdec.decoding.methods import DraftContext
    from aggdec.model.projection import OutputProjection

    return DraftContext(model, OutputProjection(model.output_weight, certify=False), False, None)


def test_auto_compiles_where_compiling_repays_itself():
    """`compile = "auto"` (`compile_choice.compile_pays`): greedy compiles a long call at batch size 1 (about 2,200
    sentences a slot cold, 42 where the store holds the step), never one sentence; a batch of 64 needs 64
    times the sentences; IAD only below batch size 3; GAD and blockwise from more sentences. The store is asked
    only where it decides, and a loop compiled in this process already compiles any call."""
    from aggdec.decoding.method_options import decode_options
    from aggdec.compile_choice import compile_pays

    def pays(requests, method="greedy", stored=None, compiled=False, **options):
        def ask():
            assert stored is not None, "the store was asked where it does not decide"
            return stored
        return compile_pays(decode_options(method, **options), requests, compiled=compiled, stored=ask)[0]

    assert not pays(1, max_batch_size=1) and not pays(1) and pays(1, max_batch_size=1, compiled=True)
    assert pays(3000, max_batch_size=1) and not pays(2000, max_batch_size=1, stored=False)
    assert pays(300, max_batch_size=1, stored=True) and not pays(300, max_batch_size=1, stored=False)
    assert not pays(30, max_batch_size=1) and not pays(2000)
    assert pays(200_000) and pays(20_000, stored=True) and not pays(20_000, stored=False)
    assert pays(20_000, "iad", max_batch_size=1) and not pays(10**7, "iad") and not pays(10**7, "iad", compiled=True)
    assert pays(10**5, "gad", drafter="d", max_batch_size=1) and not pays(90, "blockwise", drafter="d", max_batch_size=1)


def test_auto_decides_by_the_rates_measured_on_this_machine():
    """Where the store holds both backends' measured seconds a request (`compile_cache.rates`), `compile_pays`
    counts their difference instead of the method's constant: 100 sentences at batch size 1 that save 0.05 s
    each (4.8 s) compile where the step is stored, not cold; a compiled step measured slower never compiles;
    one backend's rate alone leaves the constant."""
    from aggdec.compile_choice import compile_pays
    from aggdec.decoding.method_options import decode_options

    opts = decode_options("greedy", max_batch_size=1)

    def pays(requests, rates, stored):
        return compile_pays(opts, requests, compiled=False, stored=lambda: stored, measured=lambda: rates)[0]

    fast = {"eager": 0.063, "compiled": 0.015}
    assert pays(100, fast, stored=True) and not pays(100, fast, stored=False) and pays(600, fast, stored=False)
    assert pays(30, fast, stored=True) and not pays(30, {"eager": 0.063}, stored=True)
    assert not pays(10**6, {"eager": 0.01, "compiled": 0.02}, True)
    assert compile_pays(opts, 100, compiled=False, stored=lambda: True, measured=lambda: fast)[1] == (
        "100 requests at batch size 1, measured here 16 requests/s eager, 67 compiled, stored: saves about 5 s, "
        "loading takes about 0.5 s")
    # measured compile costs replace the constants: a slow load, a fast build
    assert not pays(100, {**fast, "load": 6.0}, stored=True) and pays(100, {**fast, "build": 4.0}, stored=False)


def test_a_decode_records_the_seconds_a_request_took(monkeypatch, tmp_path):
    """A call of at least RATE_REQUESTS requests and a batch records its seconds a request under its loop's
    key, by backend; a shorter one, or a precision auto does not compile, records nothing; a new loop's
    compile records its seconds as a build or a load."""
    from aggdec.compile_choice import record, steps_key
    from aggdec.decoding.method_options import decode_options
    from aggdec.decoding.methods import get_method
    from aggdec.threads import THREADS
    from aggdec.thresholds import RATE_REQUESTS
    from test_loop import _requests
    from tiny_models import tiny_model

    monkeypatch.setattr(compile_cache, "_BASE", [str(tmp_path)])
    with THREADS.one_thread():  # busy cores change no thread count meanwhile (aggdec.threads), nor the keys
        model = tiny_model("prenorm-learned-separate", seed=3, vocab=9).float()
        context, greedy = _context(model), get_method("greedy")
        opts = decode_options("greedy", max_batch_size=4, compile=False)
        reqs = _requests(random.Random(1), RATE_REQUESTS, 9, model.cfg.eos)
        greedy.decode(opts, reqs[:-1], context)
        assert compile_cache.rates(steps_key(context, opts, "step")) == {}
        greedy.decode(opts, reqs, context)
        rate = compile_cache.rates(steps_key(context, opts, "step"))
        assert list(rate) == ["eager"] and rate["eager"] > 0, rate
        compile_cache.record_rate(steps_key(context, opts, "step"), "compiled", 0.5)
        assert compile_cache.rates(steps_key(context, opts, "step")) == {**rate, "compiled": 0.5}
        auto = decode_options("greedy", max_batch_size=4)  # every option but compile: the same loop key
        assert steps_key(context, auto, "step") == steps_key(context, opts, "step")
        half = decode_options("greedy", max_batch_size=4, compile=False, precision="bf16")
        greedy.decode(half, reqs, context)
        assert compile_cache.rates(steps_key(context, half, "step")) == {}
        one = decode_options("greedy", max_batch_size=1)  # a short call that loaded its step: the load alone
        record(context, one, "step", 3, 0.3, compiling=4.0, built=False)
        assert compile_cache.rates(steps_key(context, one, "step")) == {"load": 4.0}


def test_auto_resolves_per_call_and_says_why(monkeypatch, tmp_path):
    """`compile_choice.compiles` on an fp32 CPU verifier: `auto` compiles greedy's step for a long call at batch
    size 1, decodes a short one eagerly unless the store holds the step (`compile_cache.mark_warm`, keyed by
    the weights and the options); other precisions and float64 models quietly eager; `true` compiles."""
    from aggdec.decoding.method_options import decode_options
    from aggdec.compile_choice import compiles, steps_key as _steps_key
    from tiny_models import tiny_model

    monkeypatch.setattr(compile_cache, "_BASE", [str(tmp_path)])
    monkeypatch.setattr(compile_cache, "lowered_isa", lambda: None)
    model = tiny_model("prenorm-learned-separate", seed=3, vocab=9).float()
    context, opts = _context(model), decode_options("greedy", max_batch_size=1)
    choice, line = compiles(context, opts, 3000)
    assert choice == "step" and line.startswith("compiling the greedy step (3,000 requests at batch size 1")
    choice, line = compiles(context, opts, 300)
    assert choice is False and line.startswith("eager (greedy, 300 requests at batch size 1, not stored")
    compile_cache.mark_warm(_steps_key(context, opts, "step"))
    assert compiles(context, opts, 300) == ("step", "compiling the greedy step (300 requests at batch size 1, "
                                                    "stored: saves about 4 s, loading takes about 0.5 s)")
    other = decode_options("greedy", max_batch_size=1, max_len_b=3)  # options of its own: not stored
    assert compiles(context, other, 300)[0] is False
    twin = tiny_model("prenorm-learned-separate", seed=4, vocab=9).float()  # same shapes, other weights
    assert compiles(_context(twin), opts, 300)[0] is False
    assert compiles(context, decode_options("greedy", precision="bf16", max_batch_size=1), 3000) == (False, None)
    assert compiles(_context(tiny_model("prenorm-learned-separate", seed=3, vocab=9)), opts, 3000) == (False, None)
    assert compiles(context, decode_options("greedy", compile=True), 1) == ("step", None)
    assert compiles(context, decode_options("greedy", compile=False, max_batch_size=1), 3000) == (False, None)


def test_a_default_decode_of_one_sentence_is_eager_and_said_once(tiny_model_dir, monkeypatch, caplog):
    """Through the API with default options (`compile = "auto"`), one sentence decodes eagerly, the loop kept
    under that choice; the choice is logged once a process, however many calls make it."""
    import logging

    from aggdec import compile_choice
    from aggdec.api import Translator

    monkeypatch.setattr(compile_choice, "_SAID", set())
    tr = Translator.load(tiny_model_dir)
    with caplog.at_level(logging.INFO, logger="aggdec"):
        for _ in range(2):
            tr.translate_batch(["the cat runs ."])
    assert tr.backends == {"eager": 2}
    assert [(opts.compile, compile, stream) for opts, compile, stream in tr._slot_loops] == [("auto", False, 0)]
    said = [r.getMessage() for r in caplog.records if "compile=auto" in r.getMessage()]
    assert said == ["aggdec: compile=auto: eager (greedy, 1 request at batch size 64: would save about 0.012 s, "
                    "loading a stored step takes about 0.5 s)"], said


def test_kept_loops_are_kept_by_what_they_compile():
    """A decode's choice is part of its loop's key: options decoded eagerly, then compiled, keep a loop each
    (one built compiled, which compiles nothing until it runs), and each call takes its own back."""
    from aggdec.compile_choice import backend
    from aggdec.decoding.method_options import decode_options
    from aggdec.decoding.methods import get_method
    from tiny_models import tiny_model

    model = tiny_model("prenorm-learned-separate", seed=3, vocab=9).float()
    context, opts, greedy = _context(model), decode_options("greedy", max_batch_size=2), get_method("greedy")
    eager = greedy.loop(opts, context, greedy.drafter(opts, context), compile=False)
    compiled = greedy.loop(opts, context, greedy.drafter(opts, context), compile="step")
    assert eager is not compiled and backend(eager) == "eager" and backend(compiled) == "compiled step"
    assert list(context.slot_loops) == [(opts, False, 0), (opts, "step", 0)]
    assert greedy.loop(opts, context, greedy.drafter(opts, context), compile=False) is eager


def test_compile_seconds_count_the_calls_that_compile(monkeypatch):
    """`compile_cache.compile_seconds` grows by the calls of a `compile_step` function that traced a graph
    (here with a backend that builds nothing), not by those that ran a program already traced."""
    monkeypatch.setattr(compile_cache, "stored", lambda gm, example_inputs, options=None, pending=None: gm.forward)
    step = compile_cache.compile_step(lambda x: torch.sin(x) + 1, {})
    before = compile_cache.compile_seconds()
    step(torch.ones(3))
    traced = compile_cache.compile_seconds()
    step(torch.ones(5))
    step(torch.ones(7))
    assert traced > before and compile_cache.compile_seconds() == traced


class _Steps:
    """A step's owner: `step` adds `scale` times the first `span` of x to out, in place, where `scale` is
    not 0 (TorchDynamo guards that) and returns nothing."""

    def __init__(self, n: int, dtype: torch.dtype = torch.float32):
        self.x, self.out = torch.arange(n, dtype=dtype), torch.zeros(n, dtype=dtype)

    def step(self, scale: int, span: int) -> None:
        if scale:
            self.out[:span].add_(self.x[:span] * scale)


@compiles
def test_a_recorded_step_runs_without_torchdynamo_where_its_inputs_fit():
    """`compile_step`'s `replay`: a call traced whole into one graph without outputs is recorded, and a
    function of the same key (another loop, another process) runs the program with no TorchDynamo frame
    where the inputs fit the record: other sizes within its guards, not another dtype, nor an integer
    its guards exclude; those calls TorchDynamo traces (and they decode right either way)."""
    from torch._dynamo.utils import counters

    key = f"test-{random.random()}"
    first = _Steps(8)
    compile_cache.compile_step(first.step, {}, replay=lambda: key)(3, 5)
    assert first.out.tolist() == [0, 3, 6, 9, 12, 0, 0, 0]

    def run(owner, *args) -> tuple[int, int]:
        """(frames TorchDynamo compiled, steps replayed) by a new function of the same key running `args`."""
        frames, replayed = counters["frames"]["total"], compile_cache.COUNTS["replayed"]
        compile_cache.compile_step(owner.step, {}, replay=lambda: key)(*args)
        return counters["frames"]["total"] - frames, compile_cache.COUNTS["replayed"] - replayed

    other = _Steps(16)
    assert run(other, 5, 7) == (0, 1) and other.out.tolist() == [5.0 * i if i < 7 else 0 for i in range(16)]
    doubles = _Steps(8, torch.float64)
    assert run(doubles, 5, 7) == (1, 0) and doubles.out.tolist() == [5.0 * i if i < 7 else 0 for i in range(8)]
    zero = _Steps(8)
    assert run(zero, 0, 7)[1] == 0 and zero.out.tolist() == [0.0] * 8


def test_a_translator_digests_its_weights_once_for_its_calls(tiny_model_dir, monkeypatch, tmp_path):
    """The key of a loop's stored programs and rates (`compile_cache.steps_key`, a digest of every weight:
    seconds on a large model) is taken once a translator and options, not on each call that needs it."""
    from aggdec.api import Translator
    from aggdec.threads import THREADS
    from aggdec.thresholds import RATE_REQUESTS

    monkeypatch.setattr(compile_cache, "_BASE", [str(tmp_path)])
    digests = []
    key = compile_cache.steps_key
    monkeypatch.setattr(compile_cache, "steps_key", lambda *a: digests.append(a[1]) or key(*a))
    tr = Translator.load(tiny_model_dir)
    with THREADS.one_thread():
        for _ in range(3):  # each call long enough to record its rate (compile_choice.record)
            tr.translate_batch(["the cat runs ."] * RATE_REQUESTS, max_batch_size=4, compile=False)
    assert len(digests) == 1, digests
    assert len(compile_cache.rates(tr._steps_keys[next(iter(tr._steps_keys))])) == 1  # "eager", recorded
