"""The decode engine on a CUDA device (marked `cuda`; skipped without one). On a lent GPU, all of it:

    python -m pytest tests/test_cuda.py -m cuda -q -p no:cacheprovider

Exact equality across shapes is asserted in float64, and at fp32 and bf16 through the batch-invariant
kernels (aggdec.model.invariant): cuBLAS's and SDPA's fp32 and bf16 kernels are not batch-invariant (a row's
bits may change with the rows beside it), so without those `python -m bench gpu` reports the share of
identical outputs, and these tests assert that every step was captured and every request decoded.
In float64 the captured engine (slot loop, steps as CUDA graphs) equals eager greedy on the device; every
lossless method equals the same device's greedy; GAD++ and min-block captured equal the eager step. A run
whose shapes were seen captures nothing; an iteration synchronizes the host once; a DecodeWorker on `cuda`
decodes with the captured engine; int8 is refused in one line."""

import random
import warnings

import pyarrow as pa
import pytest
import torch
from test_loop import RandomBudget, _requests
from tiny_models import tiny_model

from aggdec.decoding.acceptance import ExactMatch, MinBlock, TopKTolerance
from aggdec.decoding.blockwise import BlockwiseHeads
from aggdec.decoding.drafters import NoDraft
from aggdec.decoding.gad_head import DraftHeadDrafter
from aggdec.decoding.iad import InputCopy
from aggdec.decoding.slot_loop import SlotLoop
from aggdec.model.draft_head import DraftHead, DraftHeadConfig
from aggdec.model.heads import ProposalHeads

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DRAFTERS = {"iad": lambda m, t: InputCopy(max_draft=4, substitution=True, nearest_match=True),
            "iad-adaptive": lambda m, t: InputCopy(max_draft=4, adaptive=True, min_draft=1),
            "gad": lambda m, t: DraftHeadDrafter(m, DraftHead(DraftHeadConfig(
                d_model=m.cfg.d_model, heads=2, ffn=24, layers=1, block_size=3)).to(**t).eval()),
            "blockwise": lambda m, t: BlockwiseHeads(m, ProposalHeads(m.cfg.d_model, 3, 32).to(**t).eval())}


def _model(dtype: torch.dtype, kind: str = "prenorm-learned-separate"):
    return tiny_model(kind, seed=3, vocab=9).to(device="cuda", dtype=dtype)


def _tokens(loop, reqs) -> dict[int, list[int]]:
    hyps = list(loop.run(reqs))
    assert sorted(h.index for h in hyps) == sorted(r.index for r in reqs)
    return {h.index: h.tokens for h in hyps}


def _assert_captured(loop) -> None:
    """Every step of the loop's capture plan was captured (a failed capture stores None and runs eagerly)."""
    assert loop._captured and all(g is not None for g in loop._captured.values()), loop._captured
    assert loop.counters.capture_failures == 0


@pytest.mark.parametrize("kind", ["prenorm-learned-separate", "t5-gated-like"])
def test_captured_greedy_equals_eager_greedy_on_the_device(kind):
    model = _model(torch.float64, kind)
    reqs = _requests(random.Random(0), 24, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    eager = _tokens(SlotLoop(model, NoDraft(), max_batch_size=4, graphs=False), reqs)
    loop = SlotLoop(model, NoDraft(), max_batch_size=4)
    assert loop.graphs
    assert _tokens(loop, reqs) == eager
    _assert_captured(loop)
    assert _tokens(SlotLoop(model, NoDraft(), max_batch_size=4, graphs="check"), reqs) == eager


@pytest.mark.parametrize("method", DRAFTERS)
def test_every_lossless_method_equals_the_devices_greedy(method):
    """At any batch composition and draft width (a random budget), captured and eager: the same
    device's greedy (float64)."""
    dtype = torch.float64
    model = _model(dtype)
    reqs = _requests(random.Random(1), 24, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    greedy = _tokens(SlotLoop(model, NoDraft(), max_batch_size=1, graphs=False), reqs)
    torch.manual_seed(1)
    drafter = DRAFTERS[method](model, {"device": "cuda", "dtype": dtype})
    for bs in (1, 3, 8):
        budget = RandomBudget(bs, drafter.max_draft or 6)
        assert _tokens(SlotLoop(model, drafter, max_batch_size=bs, budget=budget), reqs) == greedy, bs
        assert _tokens(SlotLoop(model, drafter, max_batch_size=bs, graphs=False), reqs) == greedy, bs


@pytest.mark.parametrize("acceptance", [TopKTolerance(3, 1.0), MinBlock(ExactMatch(), 2),
                                        MinBlock(TopKTolerance(2, 0.5), 2)], ids=lambda a: a.describe())
def test_captured_lossy_acceptance_equals_the_eager_loop(acceptance):
    """GAD++ and min-block run in the captured step: the eager step's output on the same device, for the
    same draft head at a fixed draft length (float64)."""
    model = _model(torch.float64)
    reqs = _requests(random.Random(2), 24, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    torch.manual_seed(2)
    drafter = DRAFTERS["gad"](model, {"device": "cuda", "dtype": torch.float64})
    rows = _tokens(SlotLoop(model, drafter, acceptance, max_batch_size=4, graphs=False), reqs)
    loop = SlotLoop(model, drafter, acceptance, max_batch_size=4)
    assert _tokens(loop, reqs) == rows
    _assert_captured(loop)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", DRAFTERS)
def test_every_method_is_captured_and_decodes_every_request_at_fp32_and_bf16(method, dtype):
    """Each drafter's captured loop at fp32 and bf16 captures every step of its plan and yields one
    hypothesis per request (equality with greedy is float64's test: these kernels are not batch-invariant)."""
    model = _model(dtype)
    reqs = _requests(random.Random(1), 24, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    torch.manual_seed(1)
    loop = SlotLoop(model, DRAFTERS[method](model, {"device": "cuda", "dtype": dtype}), max_batch_size=8)
    _tokens(loop, reqs)
    _assert_captured(loop)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_invariant_kernels_give_a_row_the_same_bits_at_any_row_count(dtype):
    """On the device: a row's product and norm are the same bits among 1, 2, 17 or 64 rows; a query's
    attention is the same alone and among others (aggdec.model.invariant)."""
    from aggdec.model import invariant

    g = torch.Generator(device="cuda").manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, device="cuda").to(dtype) for s in ((64, 96), (200, 96), (200,)))
    lin, nrm = invariant.linear(x, w, b), invariant.norm(x, w[0], b[:96], 1e-5)
    for m, at in ((1, 0), (1, 37), (2, 31), (17, 40)):
        assert torch.equal(invariant.linear(x[at: at + m], w, b), lin[at: at + m]), (m, at)
        assert torch.equal(invariant.norm(x[at: at + m], w[0], b[:96], 1e-5), nrm[at: at + m]), (m, at)
    q, k, v = (torch.randn(*s, generator=g, device="cuda").to(dtype) for s in ((6, 3, 64), (6, 50, 64), (6, 50, 64)))
    count = torch.randint(1, 50, (6, 3), generator=g, device="cuda")
    full = invariant.attend(q, k, v, count, 4)
    for i in range(6):
        assert torch.equal(invariant.attend(q[i:i + 1, 1:2], k[i:i + 1], v[i:i + 1], count[i:i + 1, 1:2], 4)[0, 0],
                           full[i, 1]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", DRAFTERS)
def test_every_lossless_method_over_the_invariant_kernels_equals_greedy_at_fp32_and_bf16(method, dtype):
    """With the batch-invariant kernels, at fp32 and bf16: the device's batch-1 greedy (also invariant) at any
    batch composition and draft width (a random budget), captured and eager."""
    model = _model(dtype)
    reqs = _requests(random.Random(1), 24, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    greedy = _tokens(SlotLoop(model, NoDraft(), max_batch_size=1, graphs=False, invariant=True), reqs)
    torch.manual_seed(1)
    drafter = DRAFTERS[method](model, {"device": "cuda", "dtype": dtype})
    for bs in (1, 3, 8):
        loop = SlotLoop(model, drafter, max_batch_size=bs, budget=RandomBudget(bs, drafter.max_draft or 6),
                        invariant=True)
        assert _tokens(loop, reqs) == greedy, bs
        _assert_captured(loop)
        assert _tokens(SlotLoop(model, drafter, max_batch_size=bs, graphs=False, invariant=True), reqs) == greedy, bs


def test_every_step_is_captured_when_a_run_starts_and_none_after(monkeypatch):
    """The capture plan is captured when the run starts (a warm-up and a capture of each step, no
    failure); then every step replays a graph (no eager step), and a second run over the same buffers
    captures nothing."""
    model = _model(torch.float32)
    reqs = _requests(random.Random(2), 16, model.cfg.src_vocab, model.cfg.eos, repeat=True)
    loop = SlotLoop(model, InputCopy(max_draft=4), max_batch_size=4)
    step, calls = SlotLoop.step, [0]

    def counted(self, *key):
        calls[0] += 1
        return step(self, *key)

    monkeypatch.setattr(SlotLoop, "step", counted)
    first = _tokens(loop, reqs)
    assert set(loop._captured) == set(loop._plan) and loop.counters.capture_failures == 0
    assert loop.counters.captures == len(loop._plan) and calls[0] == 2 * len(loop._plan)
    assert _tokens(loop, reqs) == first
    assert loop.counters.captures == len(loop._plan) and calls[0] == 2 * len(loop._plan)


def test_one_host_synchronization_per_iteration(monkeypatch):
    """Outside retiring finished rows and encoding refills, an iteration synchronizes once
    (`torch.cuda.set_sync_debug_mode`: every synchronizing operation warns)."""
    paused = [0]

    def pausing(method):
        def run(*args, **kwargs):
            paused[0] += 1
            try:
                out = method(*args, **kwargs)
                return list(out) if method.__name__ == "_retire" else out
            finally:
                paused[0] -= 1
        return run

    monkeypatch.setattr(SlotLoop, "_retire", pausing(SlotLoop._retire))
    monkeypatch.setattr(SlotLoop, "_fill", pausing(SlotLoop._fill))
    model = _model(torch.float32)
    reqs = _requests(random.Random(3), 12, model.cfg.src_vocab, model.cfg.eos)
    for drafter in (NoDraft(), InputCopy(max_draft=4, substitution=True)):
        loop = SlotLoop(model, drafter, max_batch_size=4)
        _tokens(loop, reqs)  # captures every shape of the run
        loop.counters.calls = 0
        syncs = [0]
        showwarning = warnings.showwarning

        def count(message, *args, syncs=syncs, **kwargs):
            if "synchronizing" in str(message) and not paused[0]:
                syncs[0] += 1

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = count
                _tokens(loop, reqs)
        finally:
            warnings.showwarning = showwarning
            torch.cuda.set_sync_debug_mode("default")
        assert syncs[0] == loop.counters.calls


def test_decode_worker_on_cuda_takes_the_captured_engine(tiny_model_dir):
    from conftest import synthetic_sentences

    from aggdec.api import decode_options
    from cluster.actors import DecodeWorker
    from jobs.stage import RowsTask

    texts = synthetic_sentences(20, seed=4)
    task = RowsTask(text_column="src", id_column=None)
    opts = decode_options("iad", max_batch_size=8)
    worker = DecodeWorker(str(tiny_model_dir), opts, task, device="cuda")
    out = worker(pa.table({"src": texts}))
    assert out.column("status").to_pylist() == ["ok"] * len(texts)
    loops = list(worker.translator._slot_loops.values())
    assert loops, "the worker decoded with a slot loop"
    _assert_captured(loops[0])


def test_int8_is_refused_on_cuda_before_decoding(tiny_model_dir):
    from aggdec.api import Translator

    tr = Translator.load(tiny_model_dir, device="cuda")
    for method in ("greedy", "beam"):
        with pytest.raises(ValueError, match="precision: int8 decodes on CPUs only"):
            tr.translate_batch(["the cat runs ."], method=method, precision="int8")
