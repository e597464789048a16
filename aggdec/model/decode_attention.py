"""Attention of a few decoder queries per row over each query's own number of keys, on the CPU.

`attend(q, k, v, count, heads)`: q (B,T,D) queries, already projected; k, v (B,L,D) keys and values
(views such as a prefix of a cache are read in place where their last dimension is contiguous);
count (B,T) int64, any strides (a count per row broadcast over its queries): query
[b, t] attends to keys 0 .. count[b, t] - 1 of row b (at most L); returns (B,T,D), each head's
softmax(q k^T * scale + bias) v, `scale` default (D/heads) ** -0.5. `bias` (B,heads,T,L), any
strides, optional: added to the scores of (row, head, query, key) (T5's relative positions; each
query of a block its own row of them). `rows` (B,L) int64, any strides, optional: key j of row b is
read from row rows[b, j] of k and v, which then hold any number of rows (beam search: its beams'
shared prefixes in place, where they were written, and a sentence's source shared by its beams);
an entry a query reads that is not a row of k raises. This is the masked softmax of
`MultiheadAttention.core` where the visible keys are a prefix (causal self-attention; right-padded
sources), with the same arithmetic per query (fp32 or fp64 products and sums, the softmax's maximum
subtracted) in another summation order. A query with no key gives NaN, as the masked softmax does.

Why: in a decode step the batched products over the padded layout cost more than the arithmetic.
A step's rows sit at every length up to the longest (slots refill), and TorchInductor's loops for
a handful of queries per row reduce each key's dot product across a vector; the kernel reads only
each row's own keys, one task per (row, query, head) spread over ATen's threads.

The kernel is C++ (`decode_attention.cpp`), compiled on first use with `torch.utils.cpp_extension`
for this CPU's vector instruction set (ATen's own choice, `FLAGS`), and cached per machine; a process
loads it once (`load`, about 0.1 s once built). Where it cannot be built (no C++ compiler or
ninja), `load` warns once and returns False, and callers keep the masked softmax, which computes
every padded key too and costs more set-up than one row's arithmetic (docs/design.md, "Attention
over each row's own keys").
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_attention.cpp")
OP = "decode_attention_" + hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
"""The operator, `torch.ops.aggdec.<OP>`: its name carries the source's digest, so that a program
TorchInductor compiled (and cached on disk) against another version of the kernel, whose call would
not fit this one's signature, is never reused with it."""
_loaded: bool | None = None  # None: not tried yet


FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"],
         "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2"]}
"""Compiler flags by ATen's CPU capability (`torch.backends.cpu.get_cpu_capability()`), those ATen
builds its own vectorized kernels with; any other capability builds ATen's portable vectors."""


def load() -> bool:
    """Build (first time on a machine: about 20 s) and load the kernel for this CPU; True once it is
    registered as `torch.ops.aggdec.<OP>`. Never raises: False, with one warning, where it
    cannot."""
    global _loaded
    if _loaded is None:
        try:
            build(torch.backends.cpu.get_cpu_capability())
            _loaded = True
        except Exception as e:  # a failed build: no compiler, no ninja, an unexpected toolchain
            warnings.warn(f"aggdec: the CPU decode-attention kernel could not be built ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); attention runs as masked products",
                          stacklevel=2)
            _loaded = False
    return _loaded


def build(capability: str) -> None:
    """Compile the kernel for an ATen CPU capability (`FLAGS`) into this machine's extension cache
    (one library per capability), load it and register its shapes for torch.compile. A process
    builds one: the operator's namespace is registered once."""
    from torch.utils.cpp_extension import load_inline

    flags = FLAGS.get(capability, [])
    name = "aggdec_decode_attention_" + (capability.lower() if flags else "portable")
    load_inline(name, SOURCE.read_text(), is_python_module=False,
                extra_cflags=["-O3", "-fopenmp", f"-DAGGDEC_OP={OP}", *flags], extra_ldflags=["-fopenmp"])
    torch.library.register_fake(f"aggdec::{OP}")(_shape)


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `attend` runs for tensors of this device and dtype: the CPU, fp32 or fp64, gradients
    off (the kernel has no backward), and the kernel loaded (`load`, tried here the first time; while
    torch.compile traces, only if it was loaded before)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.float64) or torch.is_grad_enabled():
        return False
    return bool(_loaded) if torch.compiler.is_compiling() else load()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: torch.Tensor, heads: int,
           rows: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    """See the module docstring. Only where `usable(q.device, q.dtype)`."""
    return getattr(torch.ops.aggdec, OP)(q, k, v, count, heads, rows, bias, scale)


def _shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: torch.Tensor, heads: int,
           rows: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    return q.new_empty(q.shape)
