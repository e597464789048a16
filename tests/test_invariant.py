"""The batch-invariant verifier (aggdec.model.invariant), proven on the CPU through Triton's interpreter:
each kernel's row results are bit-identical whatever else the call holds (row counts 1, 2, 17, 64; queries
per row; keys read past a query's own), and greedy, IAD and GAD over those kernels give identical tokens at
batch sizes 1, 8 and 64 and in another refill order. Skipped where Triton is not installed."""

import dataclasses
import os
import random

import pytest
import torch
import torch.nn.functional as F
from test_loop import _requests
from tiny_models import tiny_model

pytest.importorskip("triton", reason="the invariant kernels are Triton's (pip install triton)")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernels run on CPU tensors under Triton's interpreter (conftest sets it without a CUDA device; "
                "on a GPU, tests/test_cuda.py runs them)", allow_module_level=True)

from aggdec.api import Translator, decode_options  # noqa: E402
from aggdec.decoding.drafters import NoDraft  # noqa: E402
from aggdec.decoding.gad_head import DraftHeadDrafter  # noqa: E402
from aggdec.decoding.iad import InputCopy  # noqa: E402
from aggdec.decoding.options import OptionError  # noqa: E402
from aggdec.decoding.slot_loop import SlotLoop  # noqa: E402
from aggdec.model import invariant  # noqa: E402
from aggdec.model.draft_head import DraftHead, DraftHeadConfig  # noqa: E402

pytestmark = pytest.mark.xdist_group("triton-interpreter")


def _same_rows(full: torch.Tensor, part: torch.Tensor, at: int) -> bool:
    return torch.equal(part, full[at: at + part.shape[0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_rows_are_the_same_bits_at_any_row_count(dtype):
    """A row's product (bias, ReLU) is the same bits within 1, 2, 17 or 64 rows at any offset, and is
    the product (to rounding)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((64, 40), (70, 40), (70,)))
    with invariant.kernels():
        full = invariant.linear(x, w, b, relu=True)
        for m, at in ((1, 0), (1, 37), (2, 31), (17, 0), (17, 40), (64, 0)):
            assert _same_rows(full, invariant.linear(x[at: at + m], w, b, relu=True), at), (m, at)
    ref = F.relu(F.linear(x.float(), w.float(), b.float()))
    assert torch.allclose(full.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_norm_rows_are_the_same_bits_at_any_row_count(rms):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(64, 48, generator=g) * 3 + 1, torch.randn(48, generator=g), torch.randn(48, generator=g)
    full = invariant.norm(x, w, b, 1e-5, rms=rms)
    for m, at in ((1, 0), (1, 63), (2, 5), (17, 30)):
        assert _same_rows(full, invariant.norm(x[at: at + m], w, b, 1e-5, rms=rms), at), (m, at)
    ref = F.rms_norm(x, (48,), w, 1e-5) if rms else F.layer_norm(x, (48,), w, b, 1e-5)
    assert torch.allclose(full, ref, rtol=1e-5, atol=1e-5)


def test_attention_of_a_query_is_the_same_bits_whatever_the_call_holds():
    """A query's attention over its own keys: the same bits alone, among other queries of its row or of
    other rows, through a row map, and over a longer span of keys it does not read; with T5's bias too.
    It is the masked softmax's (to rounding)."""
    g = torch.Generator().manual_seed(2)
    b, t, heads, dh, span = 5, 3, 2, 8, 40
    q = torch.randn(b, t, heads * dh, generator=g)
    k, v = (torch.randn(b, span, heads * dh, generator=g) for _ in range(2))
    count = torch.randint(1, 37, (b, t), generator=g)
    bias = torch.randn(b, heads, t, span, generator=g)
    for with_bias in (None, bias):
        full = invariant.attend(q, k, v, count, heads, bias=with_bias)
        keep = torch.arange(span)[None, None, None, :] < count[:, None, :, None]  # (B,1,T,span)
        scores = torch.einsum("bthd,blhd->bhtl", q.double().unflatten(-1, (heads, dh)),
                              k.double().unflatten(-1, (heads, dh))) * dh**-0.5
        scores = (scores if with_bias is None else scores + with_bias.double()).masked_fill(~keep, float("-inf"))
        ref = torch.einsum("bhtl,blhd->bthd", scores.softmax(-1), v.double().unflatten(-1, (heads, dh))).flatten(2)
        assert torch.allclose(full.double(), ref, atol=1e-5)
        for i in range(b):
            for j in range(t):
                one = invariant.attend(q[i:i + 1, j:j + 1], k[i:i + 1, :30 if count[i, j] <= 30 else span],
                                       v[i:i + 1, :30 if count[i, j] <= 30 else span], count[i:i + 1, j:j + 1], heads,
                                       bias=None if with_bias is None else with_bias[i:i + 1, :, j:j + 1])
                assert torch.equal(one[0, 0], full[i, j]), (i, j)
        # every query a row of its own, reading its row's keys through a row map (the flat step's layout)
        flat = invariant.attend(q.reshape(b * t, 1, -1), k, v, count.reshape(b * t, 1), heads,
                                rows=torch.arange(b).repeat_interleave(t)[:, None].expand(b * t, span),
                                bias=None if with_bias is None else with_bias.transpose(1, 2).reshape(b * t, heads, 1, span))
        assert torch.equal(flat.view(b, t, -1), full)


def _tokens(loop, reqs) -> dict[int, list[int]]:
    hyps = list(loop.run(reqs))
    assert sorted(h.index for h in hyps) == sorted(r.index for r in reqs)
    return {h.index: h.tokens for h in hyps}


def test_lossless_methods_over_the_invariant_kernels_equal_greedy_at_any_batch(monkeypatch):
    """Greedy, IAD and GAD through the invariant kernels (every product, norm and attention: counted) give
    the tokens of batch-1 greedy at batch sizes 1, 8 and 64, and with the requests in reverse order."""
    # one layer a side and a few short requests: the interpreter takes milliseconds a kernel
    model = tiny_model("prenorm-learned-separate", seed=3, vocab=9, enc_layers=1, dec_layers=1).float().eval()
    reqs = [dataclasses.replace(r, max_len=min(r.max_len, 8))
            for r in _requests(random.Random(4), 6, model.cfg.src_vocab, model.cfg.eos, max_src=6, repeat=True)]
    calls = {"linear": 0, "norm": 0, "attend": 0}
    for name in calls:
        real = getattr(invariant, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(invariant, name, counted)
    greedy = _tokens(SlotLoop(model, NoDraft(), max_batch_size=1, invariant=True), reqs)
    assert all(calls.values()), calls
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig(d_model=model.cfg.d_model, heads=2, ffn=24, layers=1, block_size=3)).eval()
    drafters = {"greedy": NoDraft(), "iad": InputCopy(max_draft=4), "gad": DraftHeadDrafter(model, head)}
    for name, drafter in drafters.items():
        for bs in (1, 8, 64) if name != "greedy" else (8, 64):
            loop = SlotLoop(model, drafter, max_batch_size=bs, invariant=True)
            assert _tokens(loop, reqs) == greedy, (name, bs)
            if bs == 8:
                assert _tokens(loop, reqs[::-1]) == greedy, (name, "reversed")
            if name != "greedy":
                assert loop.counters.fed > loop.counters.calls  # drafts were verified: several tokens a row


def test_the_invariant_option(monkeypatch, tiny_model_dir):
    """`invariant` is refused with int8 and with compile = true, and where the kernels cannot run (on a CPU:
    without Triton's interpreter), in one line naming the option before any decoding; auto leaves it off on
    a CPU; true decodes through the kernels."""
    with pytest.raises(OptionError, match="^invariant: "):
        decode_options("greedy", invariant=True, precision="int8")
    with pytest.raises(OptionError, match="^invariant: "):
        decode_options("greedy", invariant=True, compile=True)
    tr = Translator.load(tiny_model_dir)
    line = ["She go to school ."]
    assert tr.translate_batch(line, decode_options("greedy", compile=False))[0].status == "ok"
    assert [loop.invariant for loop in tr._slot_loops.values()] == [False]
    assert tr.translate_batch(line, decode_options("iad", invariant=True))[0].status == "ok"
    assert [loop.invariant for loop in tr._slot_loops.values()] == [False, True]
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(OptionError, match="^invariant: on a CPU"):
        tr.translate_batch(line, decode_options("greedy", invariant=True))
