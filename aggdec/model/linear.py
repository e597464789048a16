"""fp32 linear layers for CPU inference, through oneDNN where that is faster than PyTorch's default
(docs/design.md, "fp32 products through oneDNN"). Only the summation order differs from `F.linear`
(about 1e-6 relative), so lossless methods stay lossless. Inference only: not with gradients, under CPU
autocast, nor within `plain_products()` (what `torch.export` traces for a compiled step).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from aggdec.model import invariant
from aggdec.thresholds import MIN_MACS, WIDE_ROW_MACS

_ONEDNN = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if _ONEDNN is not None else None
_PLAIN = contextvars.ContextVar("aggdec_plain_products", default=False)
# oneDNN reorders bf16 weights only with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere it raises
_BF16_PACK = _REORDER is not None and all(torch.cpu.get_capabilities().get(f"avx512_{x}") for x in ("bw", "vl", "dq"))


def enabled() -> bool:
    """Whether large fp32 CPU products and prepacked weights go through oneDNN here (not in `plain_products`
    nor in `invariant.kernels`)."""
    return _ONEDNN is not None and not _PLAIN.get() and not invariant.active()


def plain() -> bool:
    """Whether this runs within `plain_products`."""
    return _PLAIN.get()


@contextlib.contextmanager
def plain_products() -> Iterator[None]:
    """Within the block (this thread or task alone), every product through `F.linear` on the weights as
    they are: no oneDNN call, no prepacked weight, fused layers as one concatenated weight. What
    `torch.export` traces for TorchInductor (which chooses the products' kernels itself), and a
    baseline for tests. The output projection's top-1 is then one product and plain reductions
    (`projection.OutputProjection.top1`)."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (out, in), fp32 or bf16 on the CPU, in oneDNN's layout for `linear(..., packed=)`, with
    results equal to the unpacked ones (bf16 at any row count; fp32 from 2 rows). A snapshot: later
    changes to `weight` are not seen. None where oneDNN cannot take it."""
    if _REORDER is None or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.dtype == torch.bfloat16 and not _BF16_PACK:
        return None
    with torch.no_grad():
        return _REORDER(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """x (..., in) @ weight (out, in).T + bias (out,) -> (..., out), as `F.linear`; then ReLU if `relu`
    (fused into the oneDNN product). On oneDNN at inference while `enabled()`: fp32 products of at least
    `MIN_MACS` multiply-adds, and any with `packed` (`prepack(weight)`, optional). Within
    `invariant.kernels()`, the batch-invariant product (`invariant.linear`)."""
    if invariant.active():
        return invariant.linear(x, weight, bias, relu)
    if (enabled() and x.device.type == "cpu" and x.dtype == weight.dtype and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu")):
        if packed is not None or (x.dtype == torch.float32 and x.numel() * weight.shape[0] >= MIN_MACS):
            return _ONEDNN(x, weight if packed is None else packed, bias, "relu" if relu else "none", [], "")
    y = F.linear(x, weight, bias)
    return F.relu(y) if relu else y


def packed_for(holder: object, weight: torch.Tensor, x: torch.Tensor, min_rows: int = 1) -> torch.Tensor | None:
    """`prepack(weight)` for an fp32 or bf16 inference product x @ weight.T of at least `min_rows` rows and
    `MIN_MACS` multiply-adds, or of 2+ rows with at least `WIDE_ROW_MACS` a row; else None (also within
    `plain_products`). Kept on `holder` (attributes `_pack`, `_pack_key`): packed on first use and again
    whenever the weight's storage or version counter moves."""
    # no size test in plain products (a traced program would guard on the sizes); sizes first: most stop there
    if not enabled() or x.numel() < min_rows * weight.shape[1]:
        return None
    wide = weight.shape[0] * weight.shape[1] >= WIDE_ROW_MACS and x.numel() >= 2 * weight.shape[1]
    if (not (wide or x.numel() * weight.shape[0] >= MIN_MACS) or torch.is_grad_enabled()
            or weight.dtype not in (torch.float32, torch.bfloat16) or x.dtype != weight.dtype
            or weight.device.type != "cpu" or weight.is_inference()):
        return None
    key = (weight.data_ptr(), weight._version)
    if getattr(holder, "_pack_key", None) != key:
        holder._pack, holder._pack_key = prepack(weight), key
    return holder._pack


class PackedWeight:
    """Holds a weight's `packed_for` layout apart from the weight's owner; copies and pickles leave it out."""

    _pack: torch.Tensor | None = None
    _pack_key: tuple | None = None

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        pass


class Linear(nn.Linear, PackedWeight):
    """`nn.Linear` (same parameters and state-dict keys) whose inference goes through `linear`, its
    weight prepacked as `packed_for` decides. Copies and pickles leave the packed layout out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._packed(x))

    def relu(self, x: torch.Tensor) -> torch.Tensor:
        """relu(self(x)), the ReLU fused into the oneDNN product."""
        return linear(x, self.weight, self.bias, self._packed(x), relu=True)

    def _packed(self, x: torch.Tensor) -> torch.Tensor | None:
        return packed_for(self, self.weight, x)

    def __getstate__(self) -> dict:
        return {k: v for k, v in super().__getstate__().items() if k not in ("_pack", "_pack_key")}


class FusedLinear:
    """Several `Linear` layers applied to the same input as one product at inference: their weights
    and biases concatenated by output rows (again whenever one changes), one `linear` (prepacked as
    `packed_for` decides), split back into each layer's output. Within `plain_products` the concatenation
    is part of the traced program (freezing folds it into one constant). With gradients, or
    where the layers are not `Linear`s of one dtype and device (an int8 model's), they run one by one.
    Safe to call from several threads at once (decoding streams share a model): a concatenation is
    built whole, then published with its key in one assignment. Copies and pickles leave it out."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._fused: tuple | None = None  # (key, weight, bias): the concatenation and what it was built from
        self._pack = self._pack_key = None

    @property
    def weight(self) -> torch.Tensor | None:
        """The concatenated weight of the last inference call that fused (None before one)."""
        return None if self._fused is None else self._fused[1]

    def __call__(self, layers: tuple[nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(layer(x) for layer in layers), each (..., layer.out_features)."""
        first = layers[0].weight if isinstance(layers[0], Linear) else None
        biased = isinstance(layers[0], Linear) and layers[0].bias is not None
        if (first is None or torch.is_grad_enabled()
                or any(not isinstance(l, Linear) or (l.bias is not None) != biased or l.weight.dtype != first.dtype
                       or l.weight.device != first.device for l in layers)):
            return tuple(layer(x) for layer in layers)
        if plain():
            y = F.linear(x, torch.cat([l.weight for l in layers]),
                         torch.cat([l.bias for l in layers]) if biased else None)
            return y.split([l.out_features for l in layers], dim=-1)
        if any(l.weight.is_inference() for l in layers):
            return tuple(layer(x) for layer in layers)
        params = [p for l in layers for p in (l.weight, l.bias) if p is not None]
        key = tuple((p.data_ptr(), p._version) for p in params)
        fused = self._fused
        if fused is None or fused[0] != key:
            with torch.inference_mode(False):  # a plain tensor, so that it can be prepacked
                weight = torch.cat([l.weight.detach() for l in layers])
                bias = torch.cat([l.bias.detach() for l in layers]) if biased else None
            fused = self._fused = (key, weight, bias)
        _, weight, bias = fused
        y = linear(x, weight, bias, packed_for(self, weight, x))
        return y.split([l.out_features for l in layers], dim=-1)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._reset()
