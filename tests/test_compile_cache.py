"""A compiled slot-loop step is compiled once per machine (aggdec.compile_cache): a second process
loads the program the first one stored, without compiling, and decodes as the eager loop does; a
program holds its model's weights, so a model of the same shapes never gets another one's program.
Compiles run in processes of their own, which share a TorchInductor cache directory (`store`)."""

from __future__ import annotations

import json
import os
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
from torch._dynamo.utils import counters
from test_loop import _requests
from tiny_models import tiny_model
from aggdec.decoding.slot_loop import SlotLoop

model = tiny_model("prenorm-learned-separate", seed=int(sys.argv[1]), vocab=9).float()
reqs = _requests(random.Random(7), 8, 9, model.cfg.eos, repeat=True)
eager = {h.index: h.tokens for h in SlotLoop(model, max_batch_size=4).run(reqs)}
loop = SlotLoop(model, max_batch_size=4, compile=True)
compiled = {h.index: h.tokens for h in loop.run(reqs)}
print(json.dumps({"eager": sorted(eager.items()), "equal": compiled == eager, "compiled": loop._compiled is not None,
                  "built": counters["aggdec"]["steps_built"], "loaded": counters["aggdec"]["steps_loaded"],
                  "inductor": sorted(counters["inductor"])}))
"""
"""Greedy on 8 requests by a tiny fp32 model of seed argv[1] (Inductor's own C++ products, weights frozen),
eager and compiled: prints the eager tokens, whether the compiled ones equal them, whether the step
stayed compiled, how many programs were built and loaded, and the Inductor counters that moved (any
lowering moves some)."""


def _decode(store: Path, seed: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
               TORCHINDUCTOR_CACHE_DIR=str(store))
    env.pop("ATEN_CPU_CAPABILITY", None)
    done = subprocess.run([sys.executable, "-c", DECODE, str(seed)], env=env, cwd=store, capture_output=True, text=True,
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
    path, first = store
    second = _decode(path, 5)
    assert second["built"] == 0 and second["loaded"] >= 1 and second["inductor"] == [], second
    assert second["eager"] == first["eager"]


@compiles
def test_a_model_of_the_same_shapes_gets_a_program_of_its_own(store):
    """Model 6 after model 5, same shapes, same cache: its own program (loading 5's would decode with
    5's weights, frozen into it), which gives its own eager tokens."""
    path, first = store
    other = _decode(path, 6)
    assert other["eager"] != first["eager"]
    assert other["built"] >= 1, other


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
