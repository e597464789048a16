"""The batch-invariant verifier: products, norms and attention whose every row's result is the same,
bit for bit, whatever else the call holds (docs/design.md, "A batch-invariant verifier on GPUs").

cuBLAS picks a GEMM kernel (tiles, split-K) for each shape, so on a GPU a row's state can differ in its
last bits between a step of 1 token and one of 17 verified tokens, or between 1 row and 64, and a near-tie
then flips a token. Within `kernels()`, `linear`, `norm` and `attend` replace the model's products
(`aggdec.model.linear.linear`, every layer and the output projection), layer norms and attention
(`aggdec.model.decode_attention.attend`) with Triton kernels of fixed reduction orders
(aggdec.model.invariant_kernels). The model's other operators are elementwise (activations, residual sums,
the rules on logits), gathers (embeddings, positions, T5's bias table) or exact (the argmax of a row), so
a row's hidden states, logits and top-1 depend on that row's tokens alone: a lossless method's output is
its greedy's at any batch size and refill order. The arithmetic is the kernels' own (products in IEEE
fp32, half operands widened first; norms and softmax in fp32), so compare invariant runs with invariant
runs.

The mode is local to a thread or task (a `ContextVar`). Triton runs the kernels on CUDA tensors, and
on CPU tensors where `TRITON_INTERPRET=1` was set before the first use (slow: for tests on tiny models).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
from collections.abc import Iterator

import torch

_ACTIVE = contextvars.ContextVar("aggdec_invariant", default=False)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes the kernels take (weights, activations, caches)."""

LINEAR_TILES = (32, 64, 32)  # BLOCK_M, BLOCK_N, BLOCK_K: one tiling for every call
NORM_ROWS = 4
ATTENTION_TILES = {"cuda": (1, 64), "cpu": (16, 32)}
"""Queries a program and keys a block, by device kind: on a GPU a program per (query, head), keeping its
(keys, head dim) blocks in registers; under the interpreter, which costs milliseconds a program, 16 queries.
A query's arithmetic is the same in either (a block past its keys changes nothing)."""


def active() -> bool:
    """Whether this thread or task runs within `kernels()`, at inference (gradients off: the kernels have
    no backward)."""
    return _ACTIVE.get() and not torch.is_grad_enabled()


@contextlib.contextmanager
def kernels(on: bool = True) -> Iterator[None]:
    """Within the block (this thread or task alone), where `on`: products, norms and attention through the
    batch-invariant kernels (module docstring); `on=False` changes nothing."""
    token = _ACTIVE.set(True) if on else None
    try:
        yield
    finally:
        if token is not None:
            _ACTIVE.reset(token)


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot run a verifier of `dtype` on `device` (one line), or None: a dtype outside
    `DTYPES`, Triton missing, or a CPU without Triton's interpreter (`TRITON_INTERPRET=1`)."""
    if dtype not in DTYPES:
        return f"the kernels take fp32, bf16 or fp16 verifiers, not {dtype}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (it ships with torch's CUDA wheels; pip install triton)"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "on a CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1, slow: for tests)"
    if device.type not in ("cpu", "cuda"):
        return f"the kernels run on CUDA devices, not {device.type}"
    return None


def _kernels():
    from aggdec.model import invariant_kernels

    return invariant_kernels


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) as (M, D) with a contiguous last dimension."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """x (..., K) @ weight (N, K).T + bias (N,), then ReLU if `relu` -> (..., N) in x's dtype (`F.linear`),
    accumulated in fp32 in one tiling for every call (`LINEAR_TILES`, no split-K)."""
    if weight.dtype != x.dtype:
        raise ValueError(f"invariant linear: activations {x.dtype} against weights {weight.dtype}")
    rows, w = _rows(x), weight if weight.stride(-1) == 1 else weight.contiguous()
    (m, k), n = rows.shape, w.shape[0]
    y = rows.new_empty(m, n)
    bm, bn, bk = LINEAR_TILES
    if m:
        _kernels().linear_kernel[(_cdiv(m, bm), _cdiv(n, bn))](
            rows, w, bias if bias is not None else w, y, m, n, k, rows.stride(0), w.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, RELU=relu, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y.view(*x.shape[:-1], n)


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool = False) -> torch.Tensor:
    """A layer norm over the last dimension of x (..., D) (`rms`: T5's, without mean or bias), in fp32,
    -> x's dtype."""
    rows = _rows(x)
    m, d = rows.shape
    y = rows.new_empty(m, d)
    if m:
        _kernels().norm_kernel[(_cdiv(m, NORM_ROWS),)](
            rows, weight, bias if bias is not None else weight, y, m, d, rows.stride(0), y.stride(0), eps, RMS=rms,
            HAS_BIAS=bias is not None and not rms, BLOCK_R=NORM_ROWS, BLOCK_D=_pow2(d))
    return y.view(x.shape)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: torch.Tensor, heads: int,
           rows: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    """`aggdec.model.decode_attention.attend`'s contract (queries q (B,T,D) over their own key counts, an
    optional row map and bias), each query's softmax in fp32 over blocks of keys from key 0 -> (B,T,D) in
    q's dtype."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    b, t, d = q.shape
    dh = d // heads
    out = q.new_empty(b, t, d)
    nq = b * t
    if not nq:
        return out
    count = count.expand(b, t)
    rows_ = rows if rows is not None else count
    bias_ = bias.expand(b, heads, t, bias.shape[-1]) if bias is not None else q
    sb = bias_.stride() if bias is not None else (0, 0, 0, 0)
    sr = rows_.stride() if rows is not None else (0, 0)
    bm, bn = ATTENTION_TILES["cuda" if q.device.type == "cuda" else "cpu"]
    _kernels().attention_kernel[(_cdiv(nq, bm), heads)](
        q, k, v, count, rows_, bias_, out, nq, t, dh, dh**-0.5 if scale is None else scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), count.stride(0),
        count.stride(1), *sr, *sb, out.stride(0), out.stride(1),
        HAS_ROWS=rows is not None, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=_pow2(dh))
    return out


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
