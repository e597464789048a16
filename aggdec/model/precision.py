"""Verifier precisions: the fp32 model as trained, a bf16 copy, or an int8 copy of its linear layers.

`PRECISIONS`: "fp32" (the default, the exact result), "bf16" (every weight and activation in
bfloat16) and "int8" (W8A8: every linear layer of encoder and decoder, and the output projection,
multiplies int8 weights by int8 activations with int32 accumulation; embeddings, norms, attention
and the residual stream stay in the model's float dtype).

int8 quantization, per row on both sides:
- weights symmetric per output channel: w_q = round(w / s_w), s_w = max |w_row| / 127, once;
- activations symmetric per token: x_q = round(x / s_x), s_x = max |x_token| / 127, at every call;
- y = (x_q @ w_q.T) * s_x * s_w + bias.
The integer product is exact whatever the kernel's blocking, and every scale is a function of one
token (or one weight row) alone, so a token's output does not depend on which other tokens share the
call. That is what keeps draft -> verify exact for a quantized verifier: IAD and GAD verifying k
tokens in one call give token for token the output of the same int8 model decoding greedily one
token per call, at any batch size and refill order (tests/test_precision.py). Outputs differ from
fp32 greedy's; the benchmarks report by how much (docs/benchmarks.md).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from aggdec.model.linear import Linear
from aggdec.model.transformer import Transformer

PRECISIONS = ("fp32", "bf16", "int8")


class Int8Weight:
    """A weight (out, in) quantized per output channel; `__call__` is the W8A8 product above."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        w = weight.detach()
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(w.dtype).tiny) / 127.0
        self.qweight_t = torch.round(w / scale[:, None]).to(torch.int8).t().contiguous()  # (in, out)
        self.scale = scale  # (out,), in the model's float dtype
        self.bias = None if bias is None else bias.detach()
        self.out_features = w.shape[0]

    def __call__(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        """x (..., in) float -> (..., out) in x's dtype: int8 x int8 -> int32, rescaled, + bias."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        xq, s = quantize_rows(x)
        y = torch._int_mm(xq, self.qweight_t).to(x.dtype).mul_(self.scale)
        y = y.mul_(s) if self.bias is None else torch.addcmul(self.bias, y, s, out=y)
        if relu:
            y.relu_()
        return y.reshape(*shape[:-1], self.out_features)

    def ranking_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, in) -> (N, out): each row's logits up to a positive factor of its own (the activation
        scale is left out where there is no bias), so every row ranks tokens as `__call__` does, and a
        pass over the (N, out) result is saved. For the verifier's top-1."""
        if self.bias is not None:
            return self(x)
        xq, _ = quantize_rows(x)
        return torch._int_mm(xq, self.qweight_t).to(x.dtype).mul_(self.scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, D) float -> (x_q (N, D) int8, s (N, 1)) with x ~ x_q * s, s = max |x_row| / 127 per row."""
    s = x.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(x.dtype).tiny).div_(127.0)
    return torch.div(x, s).round_().to(torch.int8), s


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
    """`model` itself for "fp32"; otherwise a converted copy (the original is left as it is).

    bf16: `model` cast to bfloat16. int8: every `Linear` becomes an `Int8Linear` and the output
    projection an `Int8Weight` (`Transformer.output_int8`), which the verifier's top-1 and beam use;
    the float output weight stays for drafters (drafts never change a lossless output). For
    inference only. Raises ValueError naming the precision when it is not one of PRECISIONS."""
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
