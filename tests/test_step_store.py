"""A compiled slot-loop step is built once per machine (aggdec.step_store, aggdec.decoding.compiled_step): a
second process loads the package the first one stored, without exporting or compiling, and decodes as the
eager loop does; a package holds its model's weights, so a model of the same shapes gets one of its own.
The store is bounded and can be listed and cleared. `compile = "auto"` decides by what was measured.
Compiles run in processes of their own, which share a store (`store`)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import compiles

from aggdec import step_store
from aggdec.decoding.compiled_step import lowered_isa

REPO = Path(__file__).resolve().parent.parent

DECODE = """
import json, random, sys
import torch
torch.set_num_threads(1)  # the decode keeps it (aggdec.threads): no second program for another thread count
exports = []
export = torch.export.export
torch.export.export = lambda *a, **k: exports.append(1) or export(*a, **k)
from test_loop import _requests
from tiny_models import tiny_model
from aggdec.decoding.gad_head import DraftHeadDrafter
from aggdec.decoding.slot_loop import SlotLoop
from aggdec.model.draft_head import DraftHead, DraftHeadConfig

model = tiny_model("prenorm-learned-separate", seed=int(sys.argv[1]), vocab=9).float()
torch.manual_seed(0)
head = DraftHead(DraftHeadConfig(d_model=model.cfg.d_model, heads=2, ffn=24, layers=1, block_size=3)).float().eval()
reqs = _requests(random.Random(7), 8, 9, model.cfg.eos, repeat=True)
eager = {h.index: h.tokens for h in SlotLoop(model, max_batch_size=4).run(reqs)}
loop = SlotLoop(model, DraftHeadDrafter(model, head), max_batch_size=4, compile=True)
compiled = {h.index: h.tokens for h in loop.run(reqs)}
step = loop.compiled
print(json.dumps({"eager": sorted(eager.items()), "equal": compiled == eager,
                  "compiled": bool(loop.compile and step.programs), "built": step.built, "loaded": step.loaded,
                  "exports": len(exports)}))
"""
"""Greedy on 8 requests by a tiny fp32 model of seed argv[1], eager, and GAD with a random draft head (a step
with outputs: the verifier's states the head drafts from), compiled: prints the eager tokens, whether the
compiled ones equal them, whether the step stayed compiled, how many programs were built and loaded, and
how many times `torch.export` traced."""


def _env(store: Path) -> dict:
    """The environment of a `DECODE` process on the store and Inductor cache in `store`, at the CPU's ISA."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
               TORCHINDUCTOR_CACHE_DIR=str(store / "inductor"), AGGDEC_CACHE_DIR=str(store / "aggdec"))
    env.pop("ATEN_CPU_CAPABILITY", None)
    return env


def _decode_at_once(store: Path, seed: int, count: int) -> list[dict]:
    """`count` `DECODE` processes of `seed` started together on `store`: their results."""
    runs = [subprocess.Popen([sys.executable, "-c", DECODE, str(seed)], env=_env(store), cwd=store,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(count)]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        results.append(json.loads(out.splitlines()[-1]))
        assert results[-1]["compiled"] and results[-1]["equal"], (results[-1], err[-3000:])
    return results


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A store on which two processes started together decoded with model 5's step, and their results."""
    path = tmp_path_factory.mktemp("store")
    return path, _decode_at_once(path, 5, 2)


@compiles
def test_two_processes_compiling_at_once_build_the_program_once(store):
    """Two processes started together on an empty store: one exports and builds the package, under its
    key's lock; the other waits, then loads it, exporting and building nothing; both decode as the eager
    loop does."""
    _, (a, b) = store
    builder, loader = (a, b) if a["built"] else (b, a)
    assert builder["built"] == 1 and builder["exports"] == 1 and builder["loaded"] == 0, (a, b)
    assert loader["built"] == 0 and loader["exports"] == 0 and loader["loaded"] == 1, (a, b)
    assert a["eager"] == b["eager"]


@compiles
def test_a_model_of_the_same_shapes_gets_a_program_of_its_own(store):
    """Model 6 after model 5, same shapes, same store: a program of its own (loading 5's would decode with
    5's weights, frozen into it), which gives its own eager tokens."""
    path, (first, _) = store
    (other,) = _decode_at_once(path, 6, 1)
    assert other["eager"] != first["eager"]
    assert other["built"] == 1, other


def test_the_store_names_torch_and_the_cpu_and_keeps_its_bound(monkeypatch, tmp_path):
    """The store's directory names torch's version and the CPU's ISA. A package found again comes with what
    its build said of it. Past its bound, writing a package drops the least recently used others (loading
    one counts as a use), never the one just written; `clear` empties it."""
    monkeypatch.setenv("AGGDEC_CACHE_DIR", str(tmp_path))
    here = step_store.store_dir()
    assert torch.__version__ in here and torch.backends.cpu.get_cpu_capability() in here
    monkeypatch.setenv("AGGDEC_CACHE_MAX_MB", str(2.5 / 1024))  # 2.5 KiB: two packages of 1 KiB

    def build(path: str) -> dict:
        with open(path, "wb") as f:
            f.write(b"x" * 1024)
        return {"built at": path}

    for key in ("a", "b"):
        assert step_store.package(key, build, describe=f"package {key}")[1]
        time.sleep(0.05)
    a = os.path.join(here, "a.pt2")  # a use (b is now the oldest), with what its build said
    assert step_store.package("a", build) == (a, False, {"built at": a[:-4] + f".{os.getpid()}.pt2"})
    time.sleep(0.05)
    step_store.package("c", build)
    assert [(e.key, e.size, e.what) for e in step_store.entries()] == [("c", 1024, ""), ("a", 1024, "package a")]
    monkeypatch.setenv("AGGDEC_CACHE_MAX_MB", "0")
    step_store.package("d", build)
    assert [e.key for e in step_store.entries()] == ["d"]
    assert step_store.clear() >= 1024 and step_store.entries() == []


def test_aggdec_cache_lists_and_clears_the_store(monkeypatch, tmp_path):
    """`aggdec cache list` prints each package (size, last use, what it holds) and the total against the
    bound; `aggdec cache clear` empties the store."""
    from click.testing import CliRunner

    from cli import main

    monkeypatch.setenv("AGGDEC_CACHE_DIR", str(tmp_path))
    step_store.package("k1", lambda path: Path(path).write_bytes(b"x" * 3000) and {}, describe="greedy step: 2 layers")
    listed = CliRunner().invoke(main, ["cache", "list"])
    assert listed.exit_code == 0, listed.output
    assert "greedy step: 2 layers" in listed.output and "1 package" in listed.output, listed.output
    cleared = CliRunner().invoke(main, ["cache", "clear"])
    assert cleared.exit_code == 0 and step_store.entries() == [], cleared.output


def _context(model):
    from aggdec.decoding.methods import DraftContext
    from aggdec.model.projection import OutputProjection

    return DraftContext(model, OutputProjection(model.output_weight, certify=False), False, None)


def test_auto_compiles_where_compiling_repays_itself():
    """`compile = "auto"` (`compile_choice.compile_pays`) without measurements: greedy compiles a long call at
    batch size 1 (about 2,200 sentences a slot cold, 125 where the store holds the step), never one sentence;
    a batch of 64 needs 64 times the sentences; GAD and blockwise from more sentences. The store is asked
    only where it decides, and a loop compiled in this process already compiles any call."""
    from aggdec.decoding.compile_choice import compile_pays
    from aggdec.decoding.method_options import decode_options

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
    assert pays(20_000, "iad", max_batch_size=1)
    assert pays(10**5, "gad", drafter="d", max_batch_size=1) and not pays(90, "blockwise", drafter="d", max_batch_size=1)


def test_auto_decides_by_the_rates_measured_on_this_machine():
    """Where this machine measured both backends' seconds a request, `compile_pays` counts their difference
    instead of the method's constant: 100 sentences at batch size 1 that save 0.05 s each (4.8 s) compile
    where the step is stored, not cold; a compiled step measured slower never compiles; one backend's rate
    alone leaves the constant; measured build and load times replace the constants, and the line says
    the estimate used."""
    from aggdec.decoding.compile_choice import compile_pays
    from aggdec.decoding.method_options import decode_options

    opts = decode_options("greedy", max_batch_size=1)

    def pays(requests, rates, stored):
        return compile_pays(opts, requests, compiled=False, stored=lambda: stored, measured=lambda: rates)[0]

    fast = {"eager": 0.063, "compiled": 0.015}
    assert pays(100, fast, stored=True) and not pays(100, fast, stored=False) and pays(600, fast, stored=False)
    assert pays(40, fast, stored=True) and not pays(40, {"eager": 0.063}, stored=True)
    assert not pays(10**6, {"eager": 0.01, "compiled": 0.02}, True)
    assert compile_pays(opts, 100, compiled=False, stored=lambda: True, measured=lambda: {"eager": 0.01, "compiled": 0.02})[
        1] == "100 requests at batch size 1, measured here 100 requests/s eager, 50 compiled: the compiled step measured no faster here"
    assert compile_pays(opts, 100, compiled=False, stored=lambda: True, measured=lambda: {**fast, "load": 0.3})[1] == (
        "100 requests at batch size 1, measured here 16 requests/s eager, 67 compiled, stored: saves about 4.8 s, "
        "loading takes about 0.3 s")
    assert not pays(100, {**fast, "load": 6.0}, stored=True) and pays(100, {**fast, "build": 4.0}, stored=False)


def test_a_decode_records_what_it_measured(monkeypatch, tmp_path):
    """A call of at least RATE_REQUESTS requests and a batch records its seconds a request under its loop's
    key, by backend; a shorter one, or a precision auto does not compile, records nothing; a new compiled
    loop records what building its programs took and which packages hold them, after which the store is
    known to hold them, and the default decides by the rates measured."""
    from aggdec.decoding.compile_choice import compiles, steps_key
    from aggdec.decoding.method_options import decode_options
    from aggdec.decoding.methods import get_method
    from aggdec.threads import THREADS
    from aggdec.thresholds import RATE_REQUESTS
    from test_loop import _requests
    from tiny_models import tiny_model

    monkeypatch.setenv("AGGDEC_CACHE_DIR", str(tmp_path))
    with THREADS.one_thread():  # busy cores change no thread count meanwhile (aggdec.threads), nor the keys
        model = tiny_model("prenorm-learned-separate", seed=3, vocab=9).float()
        context, greedy = _context(model), get_method("greedy")
        opts = decode_options("greedy", max_batch_size=4, compile=False)
        key = steps_key(context, opts)
        reqs = _requests(random.Random(1), RATE_REQUESTS, 9, model.cfg.eos)
        greedy.decode(opts, reqs[:-1], context)
        assert step_store.rates(key) == {}
        greedy.decode(opts, reqs, context)
        rate = step_store.rates(key)
        assert list(rate) == ["eager"] and rate["eager"] > 0, rate
        assert steps_key(context, decode_options("greedy", max_batch_size=4)) == key  # every option but compile
        half = decode_options("greedy", max_batch_size=4, compile=False, precision="bf16")
        greedy.decode(half, reqs, context)
        assert step_store.rates(steps_key(context, half)) == {}
        if lowered_isa() is None:
            assert not step_store.stored(key)
            greedy.decode(decode_options("greedy", max_batch_size=4, compile=True), reqs, context)
            rate = step_store.rates(key)
            assert set(rate) == {"eager", "compiled", "build"} and step_store.stored(key), rate
            # on a store where `compile = true` ran, the default decides by what was measured, and says so
            choice, line = compiles(context, decode_options("greedy", max_batch_size=4), 10**6)
            faster = rate["compiled"] < rate["eager"]
            assert choice is faster and "measured here" in line, (rate, line)


def test_auto_resolves_per_call_and_says_why(monkeypatch, tmp_path):
    """`compile_choice.compiles` on an fp32 CPU verifier: `auto` compiles greedy's step for a long call at
    batch size 1, decodes a short one eagerly unless the store holds the loop's packages; other precisions
    and float64 models quietly eager; `true` compiles."""
    from aggdec.decoding import compile_choice
    from aggdec.decoding.compile_choice import compiles, steps_key
    from aggdec.decoding.method_options import decode_options
    from tiny_models import tiny_model

    monkeypatch.setenv("AGGDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_choice, "refused", lambda model: None)
    model = tiny_model("prenorm-learned-separate", seed=3, vocab=9).float()
    context, opts = _context(model), decode_options("greedy", max_batch_size=1)
    choice, line = compiles(context, opts, 3000)
    assert choice is True and line.startswith("compiling the greedy step (3,000 requests at batch size 1")
    choice, line = compiles(context, opts, 300)
    assert choice is False and line.startswith("eager (greedy, 300 requests at batch size 1, not stored")
    step_store.package("p", lambda path: Path(path).write_bytes(b"x") and {})
    step_store.record_packages(steps_key(context, opts), ["p"])
    assert compiles(context, opts, 300) == (True, "compiling the greedy step (300 requests at batch size 1, "
                                                  "stored: saves about 3.6 s, loading takes about 1.5 s)")
    other = decode_options("greedy", max_batch_size=1, max_len_b=3)  # options of its own: not stored
    assert compiles(context, other, 300)[0] is False
    twin = tiny_model("prenorm-learned-separate", seed=4, vocab=9).float()  # same shapes: the same programs
    assert compiles(_context(twin), opts, 300)[0] is True
    assert compiles(context, decode_options("greedy", precision="bf16", max_batch_size=1), 3000) == (False, None)
    assert compiles(_context(tiny_model("prenorm-learned-separate", seed=3, vocab=9)), opts, 3000) == (False, None)
    assert compiles(context, decode_options("greedy", compile=True), 1) == (True, None)
    assert compiles(context, decode_options("greedy", compile=False, max_batch_size=1), 3000) == (False, None)
    assert compiles(context, decode_options("iad", max_batch_size=3), 10**6) == (False, None)  # auto_below


def test_a_default_decode_of_one_sentence_is_eager_and_said_once(tiny_model_dir, monkeypatch, caplog):
    """Through the API with default options (`compile = "auto"`), one sentence decodes eagerly, the loop kept
    under that choice; the choice is logged once a process, however many calls make it."""
    import logging

    from aggdec.api import Translator
    from aggdec.decoding import compile_choice

    monkeypatch.setattr(compile_choice, "_SAID", set())
    tr = Translator.load(tiny_model_dir)
    with caplog.at_level(logging.INFO, logger="aggdec"):
        for _ in range(2):
            tr.translate_batch(["the cat runs ."])
    assert tr.backends == {"eager": 2}
    assert [(opts.compile, stream) for opts, stream in tr._slot_loops] == [("auto", 0)]
    assert not list(tr._slot_loops.values())[0].compile
    said = [r.getMessage() for r in caplog.records if "compile=auto" in r.getMessage()]
    assert said == ["aggdec: compile=auto: eager (greedy, 1 request at batch size 64: would save about 0.012 s, "
                    "loading the stored step takes about 1.5 s)"], said


def test_a_program_is_run_only_on_the_sizes_it_fixed():
    """An AOTInductor program does not check its inputs' sizes; `compiled_step._fixed` records those export
    fixed and the least of the symbolic ones, and `_check` refuses inputs that differ (the loop then decodes
    eagerly) before any program runs."""
    from aggdec.decoding.compiled_step import CompileFailed, _check, _fixed

    class Add(torch.nn.Module):
        def forward(self, x, n):
            x[: n.shape[0]].add_(1)

    x, n = torch.zeros(10), torch.empty(4, 0)
    exported = torch.export.export(Add(), (x, n), dynamic_shapes=(None, {0: torch.export.Dim.AUTO}), strict=False)
    sizes = _fixed(exported)
    assert sizes == [[0, 0, 10, 1], [1, 0, 2, 0], [1, 1, 0, 1]], sizes
    _check(sizes, (torch.zeros(10), torch.empty(7, 0)))
    for args in ((torch.zeros(12), n), (x, torch.empty(1, 0))):
        with pytest.raises(CompileFailed, match="dimension 0"):
            _check(sizes, args)
