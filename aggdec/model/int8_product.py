"""The W8A8 product of an int8 verifier as one C++ operator on the CPU (`int8_product.cpp`).

`product(x, qweight_t, scale, bias, relu, ranking)`: x (N, D) fp32, any strides, any N; qweight_t
(D, M) int8; scale (M,) fp32, contiguous; bias (M,) fp32 or None. Each row of x is quantized with a scale
of its own, s = max(max |x_row|, tiny) / 127, x_q = round(x / s) (ties to even); y = int32(x_q @
qweight_t) * scale * s (ranking: without s), + bias, relu: (N, M) fp32. Every step is rounded as
aggdec.model.precision's op-by-op variants round it (`_VARIANTS`), so the results are theirs bit for bit,
and a row's never depends on the other rows of the call. It replaces a compiled product's three
kernels and the Python around them (docs/design.md, "Fused int8 products").

The operator is built with decode attention's, into the same library per CPU capability (setup.py,
aggdec.model.decode_attention), and loaded with it. Its name carries its source's digest (`OP`), so a
library built from another version of this source has no such operator: `usable` is then False.
"""

from __future__ import annotations

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


def product(x: torch.Tensor, qweight_t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
            relu: bool = False, ranking: bool = False) -> torch.Tensor:
    """See the module docstring. Only where `usable()`."""
    return getattr(torch.ops.aggdec, OP)(x, qweight_t, scale, bias, relu, ranking)
