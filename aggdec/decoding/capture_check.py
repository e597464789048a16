"""The slot loop's step under a replayed CUDA graph's rules, on any device (`SlotLoop(graphs="check")`;
the rules: docs/design.md, "The slot loop"): no host read in the step, no state left in a tensor it
allocated, and no tensor built from host data in the step, admission or retirement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
HOST_DATA = {"tensor", "as_tensor", "asarray", "from_numpy"}
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "_unique2", "unique_dim"}


class CaptureError(RuntimeError):
    """A step that a replayed CUDA graph would not run as it ran."""


class _NoHostReads(TorchFunctionMode):
    """No host read; with `host_data=False` also no tensor built from host data (a factory from Python
    data, an index that is a list)."""

    def __init__(self, host_data: bool = True):
        super().__init__()
        self.host_data = host_data

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            raise CaptureError(f"the step reads a tensor on the host ({name}): a replay would not")
        if not self.host_data and (name in HOST_DATA or (name in ("__getitem__", "__setitem__") and _lists(args[1]))):
            raise CaptureError(f"the step, admission or retirement builds a tensor from host data ({name}): a "
                               "replay would hold its capture's data, or a copy of its own, not the loop's one copy")
        return func(*args, **(kwargs or {}))


def _lists(index: object) -> bool:
    """Whether an index holds a Python list (indexing with it copies the list to the device)."""
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


class _NoSyncingOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masks = name in ("index", "index_put", "index_put_") and any(
            t is not None and t.dtype == torch.bool for t in args[1])
        if name in SYNCING_OPS or masks:
            raise CaptureError(f"the step runs {func} (its output's size comes from the host): a replay would not")
        return func(*args, **(kwargs or {}))


def held(obj: object, path: str = "", seen: set[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor `obj` holds through objects of aggdec's classes (and their
    subclasses), dataclasses, lists, tuples and dicts; not through modules, nor oneDNN's packed weights
    (weights are no step's state)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, torch.nn.Module):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if not obj.is_mkldnn:
            yield path, obj
    elif isinstance(obj, (list, tuple, dict)):
        for k, x in obj.items() if isinstance(obj, dict) else enumerate(obj):
            yield from held(x, f"{path}[{k!r}]", seen)
    elif dataclasses.is_dataclass(obj) or any(c.__module__.startswith("aggdec.") for c in type(obj).__mro__):
        for k, x in vars(obj).items():
            yield from held(x, f"{path}.{k}", seen)


def checked(step: Callable[[], object], owner: object, outputs: str | None = None,
            host_data: bool = True) -> object:
    """Run `step()` under the rules above and return what it returns; every tensor `owner` holds
    afterwards must have existed before it, but for its attribute `outputs` (a tuple of tensors or
    None), which is copied into buffers of its own (allocated at the first step of its shapes) as a
    replay's outputs are. `host_data=False` (the step, admission, retirement): no tensor built from host data."""
    before = {t.untyped_storage().data_ptr() for _, t in held(owner)}
    with _NoHostReads(host_data), _NoSyncingOps():
        result = step()
    out = getattr(owner, outputs) if outputs else None
    if outputs:
        setattr(owner, outputs, None)
    for path, t in held(owner):
        if t.numel() and t.untyped_storage().data_ptr() not in before:
            raise CaptureError(f"the step left a tensor it allocated in {path.lstrip('.')}: a replay rewrites "
                               "it; keep state in a buffer allocated before the step, updated in place")
    if out is not None:
        static = owner.__dict__.setdefault("_static_" + outputs, {})
        key = tuple(t.shape for t in out)
        if key not in static:
            static[key] = tuple(torch.empty_like(t) for t in out)
        for dst, src in zip(static[key], out):
            dst.copy_(src)
        setattr(owner, outputs, static[key])
    return result
