"""aggdec.model.linear: the oneDNN route for large fp32 CPU inference products."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from aggdec.model import linear as lin

needs_onednn = pytest.mark.skipif(lin._ONEDNN is None, reason="PyTorch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("shape", [(64, 256, 1024), (3, 7, 256, 8000), (20, 1024, 256)])
def test_large_products_match_f_linear(shape):
    *lead, d_in, d_out = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) / d_in**0.5
    b = torch.randn(d_out, generator=g)
    assert x.numel() * d_out >= lin.MIN_MACS
    with torch.no_grad():
        y = lin.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), b.double())
    assert y.dtype == torch.float32 and y.shape == ref.shape
    # fp32 accuracy for sums of d_in terms, like F.linear's own error
    assert (y.double() - ref).abs().max() < 1e-5 * d_in**0.5 * ref.abs().max()
    assert (F.linear(x, w, b).double() - ref).abs().max() < 1e-5 * d_in**0.5 * ref.abs().max()


@needs_onednn
def test_routes_by_size_grad_and_switch(monkeypatch):
    calls = []
    real = lin._ONEDNN
    monkeypatch.setattr(lin, "_ONEDNN", lambda *a: calls.append(a[0].shape) or real(*a))
    w = torch.randn(8000, 256)
    big, small = torch.randn(4, 256), torch.randn(1, 256, 256)[:, 0]
    with torch.no_grad():
        lin.linear(big, w)
        lin.linear(small, torch.randn(256, 256))  # 65k multiply-adds: stays on F.linear
        with lin.plain_products():
            lin.linear(big, w)
        assert lin.enabled()
    assert calls == [big.shape]
    # training: autograd needs F.linear
    layer = lin.Linear(256, 8000)
    x = torch.randn(4, 256, requires_grad=True)
    layer(x).sum().backward()
    assert calls == [big.shape] and x.grad is not None and layer.weight.grad is not None


def test_linear_module_keeps_state_dict_keys():
    layer = lin.Linear(4, 3)
    assert set(layer.state_dict()) == {"weight", "bias"}
    assert isinstance(layer, torch.nn.Linear)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_weight_gives_the_unpacked_product(dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(500, 64, generator=g) / 8).to(dtype)
    packed = lin.prepack(w)
    if dtype == torch.bfloat16 and not lin._BF16_PACK:  # AVX2-only CPU: bf16 stays unpacked, no error
        assert packed is None
        return
    assert packed is not None
    x = torch.randn(7, 64, generator=g).to(dtype)
    with torch.no_grad():
        y = lin.linear(x, w, packed=packed)
        assert torch.equal(y, lin._ONEDNN(x, w, None, "none", [], ""))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(y.float(), F.linear(x.float(), w.float()), atol=tol, rtol=tol)
        with lin.plain_products():  # the plain weight then, not the packed one
            assert torch.equal(lin.linear(x, w, packed=packed), F.linear(x, w))
    assert lin.prepack(w.double()) is None


def test_cpu_autocast_is_left_to_f_linear():
    """bf16 training evaluates under no_grad + CPU autocast: its products must stay autocast's bf16."""
    layer = lin.Linear(256, 8000)
    x = torch.randn(64, 256)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    with torch.no_grad():
        assert layer(x).dtype == torch.float32


@needs_onednn
def test_linear_layer_prepacks_and_follows_weight_changes():
    """Large inference products use a packed copy of the weight, repacked after in-place updates."""
    g = torch.Generator().manual_seed(2)
    layer = lin.Linear(256, 1024)
    x = torch.randn(20, 256, generator=g)
    with torch.no_grad():
        y = layer(x)
        packed = layer._pack
        assert packed is not None and torch.equal(y, lin._ONEDNN(x, packed, layer.bias, "none", [], ""))
        assert torch.allclose(y, F.linear(x, layer.weight, layer.bias), atol=1e-5)
        layer.weight.mul_(-1)  # as an optimizer step or load_state_dict would
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)
        assert layer._pack is not packed
        assert layer._packed(x[:1]) is None  # too small: F.linear's weight
        assert torch.allclose(layer.relu(x), F.relu(F.linear(x, layer.weight, layer.bias)), atol=1e-5)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert clone._pack is None
        with torch.no_grad():
            assert torch.equal(clone(x), layer(x))


@pytest.mark.parametrize("rows", [1, 3, 24])
def test_fused_layers_give_each_layers_product_and_follow_weight_changes(rows):
    """FusedLinear: one product for q/k/v, each output as its own layer's (fp32 rounding apart),
    rebuilt after an in-place update, not kept in copies; with gradients the layers run alone."""
    g = torch.Generator().manual_seed(3)
    layers = tuple(lin.Linear(256, n) for n in (256, 256, 128))
    fused = lin.FusedLinear()
    x = torch.randn(2, rows, 256, generator=g)

    def check(outs):
        assert len(outs) == 3
        for y, layer in zip(outs, layers):
            assert y.shape == (2, rows, layer.out_features)
            assert torch.allclose(y, F.linear(x, layer.weight, layer.bias), atol=1e-5)

    with torch.no_grad():
        check(fused(layers, x))
        built = fused.weight
        assert built is not None and built.shape == (640, 256)
        layers[2].bias.add_(1.0)  # as an optimizer step or load_state_dict would
        check(fused(layers, x))
        assert fused.weight is not built
    for clone in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        assert clone.weight is None
    fresh = lin.FusedLinear()
    x.requires_grad_(True)
    outs = fresh(layers, x)
    assert fresh.weight is None  # layer by layer, so autograd reaches each weight
    sum(y.sum() for y in outs).backward()
    assert all(layer.weight.grad is not None for layer in layers) and x.grad is not None


def test_fused_layers_run_one_by_one_where_a_layer_is_not_a_linear():
    layers = (lin.Linear(8, 8), torch.nn.Identity())
    fused = lin.FusedLinear()
    x = torch.randn(3, 8)
    with torch.no_grad():
        a, b = fused(layers, x)
    assert fused.weight is None and torch.equal(b, x)
    with torch.no_grad():
        assert torch.equal(a, layers[0](x))


@needs_onednn
def test_prepacked_weights_from_two_rows_where_a_row_is_wide():
    """packed_for: wide products (>= WIDE_ROW_MACS a row) from 2 rows, narrow ones from MIN_MACS in all."""
    holder = lin.PackedWeight()
    wide, narrow, big = torch.randn(1024, 256), torch.randn(256, 256), torch.randn(1024, 1024)
    with torch.no_grad():
        assert lin.packed_for(holder, wide, torch.randn(1, 256)) is None
        assert lin.packed_for(holder, wide, torch.randn(2, 256)) is not None
        assert lin.packed_for(lin.PackedWeight(), narrow, torch.randn(8, 256)) is None
        assert lin.packed_for(lin.PackedWeight(), narrow, torch.randn(16, 256)) is not None  # 2^20
        assert lin.packed_for(lin.PackedWeight(), big, torch.randn(1, 1024)) is not None  # 2^20 at one row
    assert lin.packed_for(lin.PackedWeight(), wide, torch.randn(2, 256)) is None  # gradients: F.linear


def test_fused_layers_shared_by_threads_that_rebuild_them():
    """Two threads (decoding streams share a model) call one FusedLinear while its layers change in place,
    so that calls rebuild the concatenation: every call gives each layer's product, none fails."""
    import threading

    layers = tuple(lin.Linear(64, n) for n in (64, 32))
    fused, errors = lin.FusedLinear(), []
    x = torch.randn(4, 64)

    def work():
        try:
            for _ in range(400):
                with torch.no_grad():
                    layers[1].bias.add_(0.0)  # a new version: the next call rebuilds
                    a, b = fused(layers, x)
                assert a.shape == (4, 64) and b.shape == (4, 32)
        except Exception as e:  # (a thread's exception does not fail the test by itself)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
