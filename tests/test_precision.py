"""Verifier precisions (aggdec.model.precision): int8 products that do not depend on the call, draft ->
verify exact with respect to the converted verifier, and the option end to end."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import synthetic_sentences
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_loop import GuideDrafter, RandomBudget, _decode, _requests
from tiny_models import tiny_model

from aggdec.api import Translator
from aggdec.decoding.drafters import NoDraft
from aggdec.decoding.gad_head import DraftHeadDrafter
from aggdec.decoding.iad import InputCopy
from aggdec.decoding.method_options import decode_options, options_from_mapping
from aggdec.decoding.options import OptionError
from aggdec.model import precision
from aggdec.model.draft_head import DraftHead, DraftHeadConfig
from aggdec.model.linear import Linear
from aggdec.model.precision import Int8Linear, Int8Weight, with_precision


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int8_rows_do_not_depend_on_the_call(dtype):
    """A row's int8 product is bit for bit the same alone or among others, with and without a bias,
    and within about 2% of the float product."""
    torch.manual_seed(0)
    w, b = torch.randn(300, 96, dtype=dtype), torch.randn(300, dtype=dtype)
    x = torch.randn(257, 96, dtype=dtype) * torch.rand(257, 1, dtype=dtype) * 10
    for bias in (None, b):
        q = Int8Weight(w, bias)
        full = q(x)
        for rows in (slice(0, 1), slice(5, 6), slice(3, 70), slice(100, 257)):
            assert torch.equal(q(x[rows]), full[rows])
        ref = x @ w.T + (0 if bias is None else bias)
        assert ((full - ref).norm(dim=1) / ref.norm(dim=1)).max() < 0.02
        ranking = q.ranking_logits(x)
        assert torch.equal(ranking.argmax(dim=1), full.argmax(dim=1))
    assert torch.equal(q(torch.zeros(2, 96, dtype=dtype)), b.expand(2, -1))  # an all-zero row: no division by 0


def test_op_by_op_products_are_row_invariant_and_sum_exactly():
    """The fallback where the C++ operator is missing (precision._VARIANTS run op by op): rows
    independent of the call, and integer sums exact (equal to float64's on the same int8 values)."""
    torch.manual_seed(1)
    w, b, x = torch.randn(300, 96), torch.randn(300), torch.randn(70, 96) * 3
    q = Int8Weight(w, b)
    args = {"plain": (q.qweight_t, q.scale), "relu": (q.qweight_t, q.scale), "ranking": (q.qweight_t, q.scale),
            "bias": (q.qweight_t, q.scale, b), "bias_relu": (q.qweight_t, q.scale, b)}
    for name, fn in precision._VARIANTS.items():
        full = fn(x, *args[name])
        assert torch.equal(fn(x[4:5], *args[name]), full[4:5]) and torch.equal(fn(x[10:40], *args[name]), full[10:40])
    xq = precision.quantize_rows(x)[0]
    exact = (xq.double() @ q.qweight_t.double()).to(torch.int32)
    assert torch.equal(precision._int_product(xq, q.qweight_t), exact)


def test_the_cpu_operator_gives_the_op_by_op_products_bit_for_bit_at_every_capability():
    """aggdec's C++ int8 product (aggdec.model.int8_product), as each capability's library builds it (this
    CPU's own, AVX2's, the portable one), gives every variant's op-by-op result exactly: wide and narrow
    rows, one row alone, no rows, an all-zero row, strided columns; and the product of an fp32
    model's layers is that operator's."""
    script = """
import torch
from aggdec.model import int8_product, precision
from aggdec.model.precision import Int8Weight
assert int8_product.usable(), "the operator did not load"
torch.manual_seed(2)
for d, m in ((96, 300), (1024, 40), (7, 5)):
    w, b = torch.randn(m, d), torch.randn(m)
    x = torch.randn(70, d) * torch.rand(70, 1) * 10
    x[3] = 0
    q = Int8Weight(w, b)
    for name, bias in (("plain", ()), ("relu", ()), ("ranking", ()), ("bias", (b,)), ("bias_relu", (b,))):
        want = precision._VARIANTS[name](x, q.qweight_t, q.scale, *bias)
        got = precision.kernel(name)(x, q.qweight_t, q.scale, *bias)
        assert torch.equal(got, want), (name, d, (got - want).abs().max())
        assert torch.equal(precision.kernel(name)(x[5:6], q.qweight_t, q.scale, *bias), want[5:6]), name
        wide = torch.randn(70, 2 * d)
        wide[:, ::2] = x
        assert torch.equal(precision.kernel(name)(wide[:, ::2], q.qweight_t, q.scale, *bias), want)
        assert precision.kernel(name)(x[:0], q.qweight_t, q.scale, *bias).shape == (0, m)
    assert torch.equal(q(x), precision._VARIANTS["bias"](x, q.qweight_t, q.scale, b))
print("ok", torch.backends.cpu.get_cpu_capability())
"""
    _at_every_capability(script)


def test_the_prepacked_operator_gives_the_op_by_op_products_bit_for_bit_past_2_24():
    """The C++ operator on a weight prepacked for oneDNN (Int8Weight.packed, int8_product.prepack) gives
    every variant's op-by-op result exactly where integer sums pass 2^24 and fp32 must round them (in =
    2048, values near +-127), at 1, 2, 3 and 33 rows, strided and none, at every capability; the
    prepacked weight is made again for a copy and a pickle. Where oneDNN's sums are not exact (no VNNI)
    nothing is packed and the results are still exact (`_int_mm`)."""
    script = """
import copy, pickle
import torch
from aggdec.model import int8_product, precision
from aggdec.model.precision import Int8Weight
assert int8_product.usable(), "the operator did not load"
torch.manual_seed(3)
d, m = 2048, int8_product.PACK_MIN // 2048
w = torch.where(torch.rand(m, d) < 0.5, 1.0, -1.0) * torch.where(torch.rand(m, d) < 0.9, 1.0, 0.99)  # +-127, +-126
b = torch.randn(m)
q = Int8Weight(w, b)
exact = int8_product.onednn_exact()  # oneDNN without VNNI saturates: the operator then runs _int_mm
assert (q.packed is not None) == exact and Int8Weight(w[:-1], b[:-1]).packed is None
for clone in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
    assert not exact or torch.equal(clone.packed.to_dense(), q.packed.to_dense())
    assert torch.equal(clone(w[:3]), q(w[:3]))
rounded = 0
for n in (1, 2, 3, 33):
    x = w[:n] * torch.rand(n, 1) * 5  # row i near weight row i: sums near +-127 * 127 * 2047
    x[:, -1] = 0
    x[n // 2:] *= -1
    sums = precision._int_product(precision.quantize_rows(x)[0], q.qweight_t)
    assert (sums.abs() > 2**24).sum() >= n
    rounded += int(((sums.abs() > 2**24) & (sums.float().double() != sums.double())).sum())
    wide = torch.randn(n, 2 * d)
    wide[:, ::2] = x
    for name, bias in (("plain", ()), ("relu", ()), ("ranking", ()), ("bias", (b,)), ("bias_relu", (b,))):
        want = precision._VARIANTS[name](x, q.qweight_t, q.scale, *bias)
        for rows in (x, wide[:, ::2]):
            got = precision._OPERATORS[name](rows, q.qweight_t, q.scale, *bias, packed=q.packed)
            assert torch.equal(got, want), (name, n, (got - want).abs().max())
        assert precision._OPERATORS[name](x[:0], q.qweight_t, q.scale, *bias, packed=q.packed).shape == (0, m)
    assert torch.equal(q(x), precision._VARIANTS["bias"](x, q.qweight_t, q.scale, b))
assert rounded > 10, rounded
print("ok", torch.backends.cpu.get_cpu_capability())
"""
    _at_every_capability(script)


def test_nothing_is_prepacked_where_onednn_sums_in_saturating_pairs():
    """oneDNN's kernels as on a CPU without VNNI (its ISA capped at AVX2: u8 x s8 products added in int16
    pairs, which saturate) give other sums than exact ones: `onednn_exact` says so and no weight is
    prepacked for them."""
    script = """
import torch
from aggdec.model import int8_product
from aggdec.model.precision import Int8Weight
assert not int8_product.onednn_exact()
assert Int8Weight(torch.randn(int8_product.PACK_MIN // 512, 512)).packed is None
print("ok")
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def _at_every_capability(script: str) -> None:
    """Run `script` in a process of each capability's library (this CPU's own, AVX2's, the portable one);
    it prints "ok"."""
    for capability in (None, "avx2", "default"):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "ok" in done.stdout, (capability, done.stderr[-2000:])


def test_with_precision_converts_a_copy():
    model = tiny_model("marian-like")
    assert with_precision(model, "fp32") is model
    quantized = with_precision(model, "int8")
    assert not any(isinstance(m, Linear) for m in quantized.modules())
    assert sum(isinstance(m, Int8Linear) for m in quantized.modules()) == 2 * 6 + 2 * 10  # 2 encoder + 2 decoder layers
    assert quantized.output_int8 is not None and model.output_int8 is None
    assert any(isinstance(m, Linear) for m in model.modules())  # the original is untouched
    assert next(with_precision(model, "bf16").parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="precision: must be one of fp32, bf16, int8"):
        with_precision(model, "int4")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), kind=st.sampled_from(["shallow-decoder-tied-output", "marian-like", "double-token"]),
       precision=st.just("int8"), bs=st.integers(1, 6), refill=st.booleans(),
       budget=st.sampled_from([None, "random"]), corrupt=st.floats(0, 0.5))
def test_draft_verify_is_exact_for_the_converted_verifier(seed, kind, precision, bs, refill, budget, corrupt):
    """IAD, the draft head and guided drafts (accepted, partly accepted, rejected) on an int8 verifier
    give that verifier's own greedy output, at random batch sizes, refill orders and budgets. Not
    asserted for bf16: its products are not invariant to the call's layout on every CPU (on one
    without AVX512-BF16, IAD and greedy differed on a random bf16 model: seed 92673, marian-like)."""
    model = with_precision(tiny_model(kind, seed=seed % 5), precision)
    rng = random.Random(seed)
    reqs = _requests(rng, rng.randint(1, 8), model.cfg.src_vocab, model.cfg.eos)
    rng.shuffle(reqs)
    greedy = {i: h.tokens for i, h in _decode(model, NoDraft(), reqs, max_batch_size=1).items()}
    assume(len({tuple(t) for t in greedy.values()}) > 1 or len(greedy) == 1)  # not a constant model
    guides = {i: [t if rng.random() >= corrupt else rng.randint(0, model.cfg.tgt_vocab - 1) for t in toks + [2, 5, 6]]
              for i, toks in greedy.items()}
    torch.manual_seed(seed)
    dtype = next(model.parameters()).dtype
    head = DraftHead(DraftHeadConfig(d_model=16, heads=2, ffn=24, layers=1, block_size=3)).to(dtype).eval()
    drafters = [InputCopy(max_draft=4), GuideDrafter(guides, 2 if model.cfg.double_token else 3),
                DraftHeadDrafter(model, head)]
    for drafter in drafters:
        got = _decode(model, drafter, reqs, max_batch_size=bs, refill=refill,
                      budget=RandomBudget(seed, 4) if budget else None)
        assert {i: h.tokens for i, h in got.items()} == greedy, type(drafter).__name__


def test_precision_option_end_to_end(tiny_model_dir):
    """The option reaches the verifier, the outputs, the signature and the job spec, and int8 IAD
    gives int8 greedy's output at any batch size on a trained model.

    The trained model runs in float64 here: int8 products are exact and row-invariant whatever the
    CPU, but fp32 attention differs in the last bit between batch compositions and a per-token
    quantization can round that into another int8 value (docs/design.md, "Verifier precision"); in
    float64 such differences are 1e-16. How close int8 and bf16 outputs stay to fp32's, and how fast
    they run, depends on the CPU's instruction set: `python -m bench compare` measures it."""
    tr = Translator.load(tiny_model_dir, dtype=torch.float64)
    sents = synthetic_sentences(16, seed=3)
    outs = {}
    for method, bs in (("greedy", 16), ("greedy", 3), ("iad", 5), ("iad", 16)):
        res = tr.translate_batch(sents, method=method, precision="int8", max_batch_size=bs)
        assert all(r.status in ("ok", "truncated_output") for r in res)
        outs[method, bs] = [r.tokens for r in res]
    assert outs["greedy", 16] == outs["greedy", 3] == outs["iad", 5] == outs["iad", 16]
    assert tr.verifier("int8") is tr.verifier("int8") and tr.verifier("fp32") is tr.model
    # the int8 outputs are those of the converted model itself, decoded as the model of a Translator
    converted = Translator(dataclasses.replace(tr.bundle, model=with_precision(tr.model, "int8")))
    assert [r.tokens for r in converted.translate_batch(sents, method="greedy", max_batch_size=16)] == outs["greedy", 16]
    assert next(tr.verifier("bf16").parameters()).dtype == torch.bfloat16
    assert all(r.status in ("ok", "truncated_output") for r in tr.translate_batch(sents[:3], precision="bf16"))
    assert "precision:int8" in decode_options("iad", precision="int8").signature()
    assert decode_options("iad").signature() != decode_options("iad", precision="bf16").signature()
    opts, _ = options_from_mapping({"method": "greedy", "precision": "int8"}, "greedy")
    assert opts.precision == "int8"
    with pytest.raises(OptionError, match="^precision: must be one of fp32, bf16, int8"):
        decode_options("greedy", precision="fp16")


# What torch.cpu.get_capabilities() reports on each kind of CPU the project runs on (the flags cpu_isa reads).
CPUS = {
    "amx": {"avx2": True, "avx512_f": True, "avx512_vnni": True, "avx512_bf16": True, "amx_tile": True},
    "avx512_vnni": {"avx2": True, "avx512_f": True, "avx512_vnni": True, "avx512_bf16": True, "amx_tile": False},
    "avx_vnni": {"avx2": True, "avx_vnni": True, "avx512_f": False},
    "avx512": {"avx2": True, "avx512_f": True, "avx512_vnni": False},
    "avx2": {"avx2": True, "avx512_f": False, "avx512_vnni": False, "avx_vnni": False, "amx_tile": False},
    "other": {"architecture": "aarch64"},
}


@pytest.mark.parametrize("isa", list(CPUS))
def test_precision_warning_by_instruction_set(isa):
    """int8 is flagged where the CPU has neither VNNI nor AMX, bf16 where it has no AMX (both with
    the measured figure), fp32 never; a CPU of an unmeasured kind gets no warning."""
    assert precision.cpu_isa(CPUS[isa]) == isa
    int8, bf16 = (precision.cpu_warning(p, isa) for p in ("int8", "bf16"))
    assert precision.cpu_warning("fp32", isa) is None
    assert (int8 is not None) == (isa in ("avx2", "avx512"))
    assert (bf16 is not None) == (isa not in ("amx", "other"))
    for warning in filter(None, (int8, bf16)):
        assert "\n" not in warning and "x slower than fp32 on " in warning


def test_this_cpu_gets_a_consistent_precision_warning(tiny_model_dir):
    """The real detection on the machine running the tests yields a class, and converting the
    verifier warns (once) exactly where cpu_warning says so for that class."""
    isa = precision.cpu_isa()
    assert isa in precision.ISAS
    tr = Translator.load(tiny_model_dir)
    for p in ("int8", "bf16"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tr.verifier(p)
            tr.verifier(p)
        assert [str(w.message) for w in caught] == [m for m in [precision.cpu_warning(p, isa)] if m]
