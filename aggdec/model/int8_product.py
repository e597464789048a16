"""The W8A8 product of an int8 verifier as one C++ operator on the CPU (`int8_product.cpp`).

`product(x, qweight_t, scale, bias, relu, ranking, packed)`: x (N, D) fp32, any strides, any N;
qweight_t (D, M) int8; scale (M,) fp32, contiguous; bias (M,) fp32 or None; packed None or
`prepack(qweight_t)`. Each row of x is quantized with a scale of its own, s = max(max |x_row|, tiny) /
127, x_q = round(x / s) (ties to even); y = float(int32(x_q @ qweight_t)) * scale * s (ranking: without
s), + bias, relu: (N, M) fp32. Every step is rounded as aggdec.model.precision's op-by-op variants round
it (`_VARIANTS`), so the results are theirs bit for bit, and a row's never depends on the other rows of
the call. It replaces a compiled product's three kernels and the Python around them (docs/design.md,
"Fused int8 products").

The integer sums are exact either way: with `packed`, oneDNN's u8 x s8 product (x_q + 128, zero point
128) on the prepacked weight, which gives each sum converted to fp32 as float(int32) rounds it (to
nearest, ties to even, past 2^24 too: tests/test_precision.py); without, ATen's int8 x int8 -> int32
`_int_mm`. `prepack` decides which weights are packed (`PACK_MIN`, and only where oneDNN's sums are exact:
`onednn_exact`, CPUs with VNNI or AMX).

The operator is built with decode attention's, into the same library per CPU capability (setup.py,
aggdec.model.decode_attention), and loaded with it. Its name carries its source's digest (`OP`), so a
library built from another version of this source has no such operator: `usable` is then False.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("int8_product.cpp")
OP = "int8_product_" + hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
"""The operator, `torch.ops.aggdec.<OP>` (setup.py builds it with `-DAGGDEC_INT8_OP=<OP>`)."""

_usable: bool | None = None  # None: not asked yet


def usable() -> bool:
    """Whether the operator is loaded: the library of aggdec's CPU kernels loads (decode_attention.load)
    and holds this version of it. Asked once a process; where the library holds another version, one
    warning says how to rebuild it."""
    global _usable
    if _usable is None:
        from aggdec.model import decode_attention

        loaded = decode_attention.load()
        _usable = loaded and hasattr(torch.ops.aggdec, OP)
        if loaded and not _usable:
            warnings.warn(f"aggdec: the CPU kernels' library was built from another version of {SOURCE.name}; "
                          f"int8 products run op by op, slowly; rebuild it by reinstalling aggdec "
                          f"(`{decode_attention.REBUILD}` in its checkout)", stacklevel=2)
    return _usable


PACK_MIN = 1 << 20
"""Weights of at least this many elements are prepacked for oneDNN (`prepack`). Measured against `_int_mm`
(1 and 2 threads, 1 to 32 rows, an AVX-512 VNNI CPU): 2 to 4x faster on a 512 x 58,101 weight, 5 to 40%
faster on 512 x 2048 and 2048 x 512 ones, but up to 1.5x slower on 512 x 512 ones at 1 to 8 rows (its
fixed cost a call, 5 to 10 µs)."""


@functools.cache
def onednn_exact() -> bool:
    """Whether oneDNN's u8 x s8 product sums exactly here. With VNNI or AMX it does; without (AVX2, AVX-512
    without VNNI, or `ONEDNN_MAX_CPU_ISA` below them) it adds pairs of products in int16 with saturation
    (255 x 127 x 2 > 32,767) and gives other sums. Checked once a process, on those extreme values."""
    if not torch.backends.mkldnn.is_available():
        return False
    w = torch.full((8, 64), 127, dtype=torch.int8)
    x = torch.full((2, 64), 255, dtype=torch.uint8)  # x_q = 127 at zero point 128
    y = torch.ops.onednn.qlinear_pointwise(x, 1.0, 128, torch.ops.onednn.qlinear_prepack(w, None), torch.ones(8),
                                           torch.zeros(8, dtype=torch.int32), None, 1.0, 0, torch.float32, "none",
                                           [], "")
    return bool((y == 127 * 127 * 64).all())


def prepack(qweight_t: torch.Tensor) -> torch.Tensor | None:
    """qweight_t (D, M) int8 as oneDNN's product takes it (`product`'s `packed`: an mkldnn tensor, which
    neither copies nor pickles), or None where `PACK_MIN` says it does not pay or oneDNN's product is not
    exact here (`onednn_exact`)."""
    if qweight_t.numel() < PACK_MIN or not onednn_exact():
        return None
    return torch.ops.onednn.qlinear_prepack(qweight_t.t().contiguous(), None)  # (M, D), which must be contiguous


def product(x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
            relu: bool = False, ranking: bool = False, packed: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. Only where `usable()`."""
    return getattr(torch.ops.aggdec, OP)(x, qweight_t, scale, bias, relu, ranking, packed)
