"""Attention of a few decoder queries per row over each query's own number of keys, on the CPU.

`attend(q, k, v, count, heads)`: q (B,T,D) queries, already projected; k, v (B,L,D) keys and values
(views such as a prefix of a cache are read in place where their last dimension is contiguous);
count (B,T) int64, any strides: query [b, t] attends to keys 0 .. count[b, t] - 1 of row b (at most
L); returns (B,T,D), each head's softmax(q k^T * scale + bias) v, `scale` default (D/heads) ** -0.5.
`bias` (B,heads,T,L), any strides, optional: added to the scores of (row, head, query, key) (T5's
relative positions). `rows` (B,L) int64, any strides, optional: key j of row b is read from row
rows[b, j] of k and v, which then hold any number of rows (beam search's shared prefixes and
sources); an entry a query reads that is not a row of k raises. This is the masked softmax of
`MultiheadAttention.core` where the visible keys are a prefix (causal self-attention; right-padded
sources), with the same arithmetic per query (fp32 or fp64, the softmax's maximum subtracted) in
another summation order. A query with no key gives NaN, as the masked softmax does.

The kernel is C++ (`decode_attention.cpp`), built at install time (`setup.py`) as one library per
CPU capability (`library`, `FLAGS`); a process loads the one for its capability (`load`) and never
compiles it. Where it is missing or does not load, `load` warns once and callers keep the masked
softmax (docs/design.md, "Attention over each row's own keys").
"""

from __future__ import annotations

import hashlib
import json
import warnings
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlsplit

import torch

from aggdec.model import invariant

SOURCE = Path(__file__).with_name("decode_attention.cpp")
OP = "decode_attention_" + hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
"""The operator, `torch.ops.aggdec.<OP>`: its name carries the source's digest, so that no program
TorchInductor cached against another version of the kernel calls this one."""
_loaded: bool | None = None  # None: not tried yet


FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"],
         "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2"]}
"""Compiler flags by ATen's CPU capability, as ATen builds its own vectorized kernels; any other
capability has the library of ATen's portable vectors. `setup.py` adds `CFLAGS` and `-DAGGDEC_OP=<OP>`."""
CFLAGS = ["-O3", "-fopenmp", "-g0"]  # -g0: without the debug information Python's flags ask for, a fifth faster
REBUILD = "pip install --no-build-isolation -e ."  # how a checkout builds the libraries, against the installed torch


def library(capability: str) -> Path:
    """The library built for an ATen CPU capability, next to this file (the portable one outside `FLAGS`)."""
    return Path(__file__).with_name(f"_decode_attention_{capability.lower() if capability in FLAGS else 'portable'}.so")


def load() -> bool:
    """Load the kernel built for ATen's CPU capability (which ATEN_CPU_CAPABILITY can lower); True once
    it is registered. Never compiles or raises: False, with one warning a process, where it cannot load."""
    global _loaded
    if _loaded is None:
        capability = torch.backends.cpu.get_cpu_capability()
        try:
            load_library(capability)
            _loaded = True
        except Exception as e:  # not built, built against another torch, or from another source
            warnings.warn(f"aggdec: the CPU decode-attention kernel is not available ({library(capability).name}: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}); attention runs as masked "
                          f"products; rebuild it by reinstalling aggdec (`{REBUILD}` in its checkout)", stacklevel=2)
            _loaded = False
    return _loaded


def load_library(capability: str) -> None:
    """Load the library built for an ATen CPU capability (`library`, else its copy in the installed
    aggdec: `_installed`) and register its shapes for torch.compile (once a process). Raises
    FileNotFoundError where it was not built, OSError where it does not link with this torch,
    RuntimeError where it was built from another version of the source (its operator is not `OP`)."""
    path = next((p for p in (library(capability), _installed(library(capability))) if p and p.is_file()), None)
    if path is None:
        raise FileNotFoundError("not built")
    torch.ops.load_library(str(path))
    if not hasattr(torch.ops.aggdec, OP):
        raise RuntimeError(f"built from another version of {SOURCE.name}")
    torch.library.register_fake(f"aggdec::{OP}")(_shape)


def _installed(path: Path) -> Path | None:
    """`path`, a file of this copy of the package, in the aggdec installed in this environment, if
    any (an editable install's checkout, else the installed files): a Jobs API job's uploaded
    checkout has no built libraries (they are git-ignored)."""
    try:
        dist = metadata.distribution("aggdec")
    except metadata.PackageNotFoundError:
        return None
    origin = json.loads(dist.read_text("direct_url.json") or "{}")
    if origin.get("dir_info", {}).get("editable") and origin.get("url", "").startswith("file://"):
        root = Path(unquote(urlsplit(origin["url"]).path))
    else:
        root = Path(dist.locate_file(""))
    return root / path.relative_to(Path(__file__).parents[2])


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `attend` runs for tensors of this device and dtype, gradients off (no backward): within
    `invariant.kernels()`, `invariant.DTYPES` on any device (the batch-invariant kernel); else the CPU, fp32
    or fp64, and the kernel loaded (`load`)."""
    if invariant.active():
        return dtype in invariant.DTYPES
    return device.type == "cpu" and dtype in (torch.float32, torch.float64) and not torch.is_grad_enabled() and load()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: torch.Tensor, heads: int,
           rows: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    """See the module docstring. Only where `usable(q.device, q.dtype)`."""
    if invariant.active():
        return invariant.attend(q, k, v, count, heads, rows, bias, scale)
    return getattr(torch.ops.aggdec, OP)(q, k, v, count, heads, rows, bias, scale)


def _shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: torch.Tensor, heads: int,
           rows: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    return q.new_empty(q.shape)
