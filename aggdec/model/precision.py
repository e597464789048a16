"""Verifier precisions (`PRECISIONS`, the `precision` option): the fp32 model as trained, a bf16 copy,
or an int8 copy of its linear layers (docs/design.md, "Verifier precision"). int8 is W8A8 with a scale
per output channel (weights, once) and per token (activations, every call), y = (x_q @ w_q.T) * s_x *
s_w + bias, so a token's output does not depend on which other tokens share the call.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from aggdec.model import int8_product
from aggdec.model.config import PRECISIONS
from aggdec.model.linear import Linear
from aggdec.model.transformer import Transformer

ISAS = ("amx", "avx512_vnni", "avx_vnni", "avx512", "avx2", "other")
"""CPU classes by what decides the cost of bf16 and int8 products, best first (`cpu_isa`)."""

_ISA_FLAGS = (("amx", "amx_tile"), ("avx512_vnni", "avx512_vnni"), ("avx_vnni", "avx_vnni"),
              ("avx512", "avx512_f"), ("avx2", "avx2"))

_AVX2 = "gec-base IAD at batch 32 ran {}x slower than fp32 on an AVX2 CPU"
_NO_AMX = "gec-base IAD at batch 32 ran 1.4x slower than fp32 on a CPU with AVX512-BF16 and VNNI but no AMX"
_SLOW = {  # (precision, isa) -> why it is slow there, measured (docs/design.md, "Precision by instruction set")
    ("int8", "avx2"): "int8 products have no fast path without VNNI or AMX: " + _AVX2.format(16),
    ("int8", "avx512"): "this CPU has neither VNNI nor AMX for int8 products (not measured on AVX-512 without "
                        "VNNI); " + _AVX2.format(16),
    ("bf16", "avx2"): "bf16 products have no native instructions without AVX512-BF16 or AMX: " + _AVX2.format(2.8),
    ("bf16", "avx512"): "this CPU has neither AVX512-BF16 nor AMX for bf16 products (not measured on AVX-512 "
                        "without VNNI); " + _AVX2.format(2.8),
    ("bf16", "avx512_vnni"): "bf16 needs AMX to pay: " + _NO_AMX,
    ("bf16", "avx_vnni"): "bf16 needs AMX to pay (not measured on CPUs with AVX-VNNI); " + _NO_AMX,
}


def refuse_int8(device: torch.device) -> None:
    """Raise ValueError (one line) where int8 decoding cannot run on `device`: a CUDA device."""
    if device.type == "cuda":
        raise ValueError("precision: int8 decodes on CPUs only (CUDA's int8 product refuses calls of fewer than 17 "
                         "rows); on a GPU use fp32 or bf16")


def cpu_isa(capabilities: Mapping[str, Any] | None = None) -> str:
    """The class (`ISAS`, the first whose flag is set) of a CPU with these capability flags (default:
    this CPU's, `torch.cpu.get_capabilities()`); "other" for none (another architecture, no AVX2)."""
    caps = getattr(torch.cpu, "get_capabilities", dict)() if capabilities is None else capabilities
    return next((isa for isa, flag in _ISA_FLAGS if caps.get(flag)), "other")


def cpu_warning(precision: str, isa: str) -> str | None:
    """One line saying why `precision` is expected to run much slower than fp32 on a CPU of class
    `isa` (`cpu_isa`), with the measured figure; None where it pays, for fp32 and for "other"."""
    why = _SLOW.get((precision, isa))
    return None if why is None else f"precision {precision}: {why}; fp32 is the faster choice here"


class Int8Weight:
    """A weight (out, in) quantized per output channel; `__call__` is the W8A8 product above. `packed`:
    the weight as the C++ operator's oneDNN product takes it (`int8_product.prepack`), or None. Copies and
    pickles prepack it again."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        qweight, scale = quantize_rows(weight.detach())  # a weight row quantizes as a token does
        self.qweight_t = qweight.t().contiguous()  # (in, out)
        self.scale = scale[:, 0]  # (out,), in the model's float dtype
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach()
        self.packed = self._prepack()

    def _prepack(self) -> torch.Tensor | None:
        return int8_product.prepack(self.qweight_t) if _operator(self.scale.dtype) else None

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "packed"}  # an mkldnn tensor neither copies nor pickles

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.packed = self._prepack()

    def __call__(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """x (..., in) float -> (..., out) in x's dtype: int8 x int8 -> int32, rescaled, + bias."""
        bias = () if self.bias is None else (self.bias,)
        name = ("bias_relu" if relu else "bias") if bias else ("relu" if relu else "plain")
        y = self._run(name, x.reshape(-1, x.shape[-1]), *bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def ranking_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, in) -> (N, out): each row's logits up to a positive factor of its own (no activation scale
        where there is no bias), so every row ranks tokens as `__call__` does. For the verifier's top-1."""
        return self(x) if self.bias is not None else self._run("ranking", x)

    def _run(self, name: str, x: torch.Tensor, *bias: torch.Tensor) -> torch.Tensor:
        """`kernel(name, x.dtype)` on x (N, D), detached, and this weight (prepacked, where it is: then the
        kernel is the operator, as the packing asked `_operator` of the same dtype)."""
        packed = {} if self.packed is None else {"packed": self.packed}
        return kernel(name, x.dtype)(x.detach(), self.qweight_t, self.scale, *bias, **packed)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, D) float -> (x_q (N, D) int8, s (N, 1)) with x ~ x_q * s, s = max |x_row| / 127 per row."""
    s = x.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny) / 127.0
    return torch.round(x / s).to(torch.int8), s


def _int_product(xq: torch.Tensor, qweight_t: torch.Tensor) -> torch.Tensor:
    """xq (N, D) int8 @ qweight_t (D, M) int8, summed exactly in int32 (as the C++ operator sums)."""
    return xq.to(torch.int32) @ qweight_t.to(torch.int32)


def _product(x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    xq, s = quantize_rows(x)
    return _int_product(xq, qweight_t).to(x.dtype) * scale * s


def _ranking(x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _int_product(quantize_rows(x)[0], qweight_t).to(x.dtype) * scale


_VARIANTS = {
    "plain": _product,
    "relu": lambda x, w, s: _product(x, w, s).relu(),
    "bias": lambda x, w, s, b: _product(x, w, s) + b,
    "bias_relu": lambda x, w, s, b: (_product(x, w, s) + b).relu(),
    "ranking": _ranking,
}


_OPERATORS = {name: functools.partial(int8_product.product, relu=relu, ranking=ranking)
              for name, relu, ranking in (("plain", False, False), ("relu", True, False), ("bias", False, False),
                                          ("bias_relu", True, False), ("ranking", False, True))}
"""Each variant of `_VARIANTS` as aggdec's C++ operator takes it (where `_operator`)."""


def _operator(dtype: torch.dtype) -> bool:
    """Whether products of inputs of `dtype` run as aggdec's C++ operator (fp32, where it is loaded)."""
    return dtype == torch.float32 and int8_product.usable()


def kernel(name: str, dtype: torch.dtype = torch.float32) -> Callable:
    """The W8A8 product `name` of `_VARIANTS` for inputs of `dtype`: for fp32, aggdec's C++ operator
    (aggdec.model.int8_product, the variants' arithmetic bit for bit); else (float64 models, a library
    without the operator) the variants op by op, exact integer sums on ATen's generic kernels (slow)."""
    return _OPERATORS[name] if _operator(dtype) else _VARIANTS[name]


class Int8Linear(nn.Module):
    """Stands in for a `Linear` in an int8 model: the same call and `relu` (inference only)."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.int8 = Int8Weight(layer.weight, layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.int8(x)

    def relu(self, x: torch.Tensor) -> torch.Tensor:
        return self.int8(x, relu=True)


def with_precision(model: Transformer, precision: str) -> Transformer:
    """`model` itself for "fp32"; otherwise a converted copy for inference. bf16: cast to bfloat16.
    int8: every `Linear` becomes an `Int8Linear`, and the output projection an `Int8Weight`
    (`Transformer.output_int8`) for the verifier's top-1 and beam, the float weight kept for
    drafters. Raises ValueError naming the precision when it is not one of PRECISIONS."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if precision == "fp32":
        return model
    if precision == "bf16":
        return copy.deepcopy(model).to(torch.bfloat16).eval()
    quantized = copy.deepcopy(model).eval()
    for module in list(quantized.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Linear) and not (module is quantized.decoder and name == "output_projection"):
                setattr(module, name, Int8Linear(child))
    quantized.output_int8 = Int8Weight(quantized.output_weight, quantized.output_bias)
    return quantized
