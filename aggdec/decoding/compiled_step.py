"""A slot loop's step compiled on the CPU through torch's public APIs (docs/design.md, "Compiled on the
CPU"): `torch.export` traces the step over the loop's buffers, `aoti_compile_and_package` compiles it
with TorchInductor into an AOTInductor package kept in aggdec's store (aggdec.step_store), and
`aoti_load_package` runs it in this and every later process: no TorchDynamo, no tracing once stored.

The program takes every tensor the step reads or writes as an input (the state's, the cache's, the
statistics', the drafter's rows: `SlotLoop.buffers`); the model's weights are frozen into it as
constants, so a package is keyed by their bytes and serves that model alone. Integers (the rows' draft
width, the key positions and source positions read) reach it as the sizes of an empty tensor; sizes are
symbolic, so one program serves every slot count, width, span and cache size of its loop. A step that
drafts and one that does not are two programs (width 0 takes no draft); a width of 1 runs as 2 (export
takes sizes 0 and 1 as fixed), which drafts a token more and changes no output.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import os
import time
import warnings
from typing import Any

import torch

from aggdec import step_store
from aggdec.model.linear import plain_products
from aggdec.model.projection import OutputProjection
from aggdec.thresholds import CPP_GEMM_SLOTS


def inductor_options(dtype: torch.dtype, slots: int, drafts: bool) -> dict[str, Any]:
    """TorchInductor's options for the package of a step over `slots` slots: a C++ wrapper; the weights frozen
    into the program as constants (a batch-1 `ende-base` step took 0.63 ms frozen, 2.3 ms with the weights
    supplied by the model); products by Inductor's C++ template for fp32 steps of at most `CPP_GEMM_SLOTS`
    slots (0.2 ms), else by ATen's, as in a step that verifies `drafts` (many rows a slot). A double-token
    model's pairs (two rows a slot) take the template too."""
    gemm = "CPP" if dtype == torch.float32 and slots <= CPP_GEMM_SLOTS and not drafts else "ATEN"
    return {"cpp_wrapper": True, "freezing": True, "max_autotune": True, "max_autotune_gemm_backends": gemm}


_SPENT = [0.0]  # compile_seconds


def compile_seconds() -> float:
    """Seconds this process spent building and loading step programs."""
    return _SPENT[0]


@functools.lru_cache(maxsize=4096)
def _carrier(width: int, span: int, src_width: int) -> torch.Tensor:
    """The integers of a step as the sizes of an empty tensor, each shifted by 2 (export fixes sizes 0 and 1)."""
    return torch.empty((width + 2, span + 2, src_width + 2, 0), dtype=torch.uint8)


class _Traced(torch.nn.Module):
    """The loop's step over explicit buffers, for `torch.export`: the model as a submodule (its weights
    are the program's constants), each buffer of `names` an input, the integers as `_carrier` sizes."""

    def __init__(self, loop: Any, drafts: bool, names: list[str]):
        super().__init__()
        self.model = loop.model
        object.__setattr__(self, "loop", loop)  # not a submodule: its tensors are inputs
        self.drafts, self.names = drafts, names
        for name in _CONSTANTS:  # constants of the program (the loop's key holds their values)
            self.register_buffer(name, getattr(loop, name), persistent=False)

    def forward(self, *inputs: torch.Tensor):
        """inputs: the buffers of `names`, then the width, span and source width as one `_carrier`."""
        *buffers, sizes = inputs
        loop, model = self.loop, self.model
        kept, projection, constants = loop.buffers(), loop.projection, {name: getattr(loop, name) for name in _CONSTANTS}
        try:
            loop.bind(dict(zip(self.names, buffers)))
            for name in _CONSTANTS:
                setattr(loop, name, getattr(self, name))
            # the projection of the traced weights (the loop's holds the real ones, and a packed copy)
            loop.projection = OutputProjection(model.output_weight, certify=False, bias=model.output_bias, pack=False)
            width, span, src_width = (n - 2 for n in sizes.shape[:3])
            loop.step(width if self.drafts else 0, span, src_width)
        finally:
            loop.bind(kept)
            loop.projection = projection
            for name, value in constants.items():
                setattr(loop, name, value)
        return loop.states


_CONSTANTS = ("forced", "starts", "_zero")
"""The loop's constant tensors that its step reads, frozen into the program."""


class CompiledStep:
    """`loop`'s step (`SlotLoop.step`) as AOTInductor programs, one for steps that draft and one for steps
    that do not, each loaded from the store or built there on its first call (`step_store.package`).
    `built` and `loaded`: programs this object built or loaded; `seconds`: what that took; `keys`: their
    packages' keys."""

    def __init__(self, loop: Any):
        self.loop = loop
        self.programs: dict[bool, Any] = {}
        self.fixed: dict[bool, list] = {}  # each program's fixed sizes (`_fixed`)
        self._checked: dict[bool, tuple] = {}  # the buffers each program's sizes were last checked on
        self.keys: list[str] = []  # the packages of `programs`
        self.built = self.loaded = 0
        self.seconds = 0.0
        self._key = _loop_key(loop)
        drafts = loop.drafter.max_draft != 0
        slots = 1 << (loop.max_batch_size - 1).bit_length()  # (slot_loop.slot_count)
        self.options = inductor_options(loop.dtype, slots, drafts)

    def __call__(self, width: int, span: int, src_width: int) -> None:
        """Run the step in place (its states, for a drafter that drafts from them, as the eager step
        leaves them). `width` must not be 1. Raises CompileFailed where a program cannot be had, or where
        the loop's buffers differ from its program's in a size that program fixed."""
        drafts = width > 0
        buffers = self.loop.buffers()
        args = (*buffers.values(), _carrier(width, span, src_width))  # (flat: 1.5x faster calls than nested)
        program = self.programs.get(drafts)
        if program is None:
            program = self.programs[drafts] = self._program(drafts, list(buffers), args)
        checked = self._checked.get(drafts, ())
        if len(checked) != len(buffers) or not all(map(operator.is_, checked, args)):  # new buffers: checked once
            _check(self.fixed[drafts], args)
            self._checked[drafts] = args[:-1]  # (held, so that no new buffer takes an old one's identity)
        states = program(*args)
        if self.loop.drafter.from_states:
            self.loop.states = states

    def _program(self, drafts: bool, names: list[str], args: tuple) -> Any:
        """The loaded program of the step that `drafts` or not, built first where the store lacks it."""
        t0 = time.perf_counter()
        key = hashlib.sha256(f"{self._key}|drafts {drafts}|{names}|{sorted(self.options.items())}".encode()).hexdigest()

        def build(path: str) -> dict:
            step_store.inductor_cache()
            dims = (tuple({i: torch.export.Dim.AUTO for i in range(t.dim())} for t in args),)  # (*inputs)
            notes = logging.getLogger("torch._export.non_strict_utils")  # a line for every size export fixes
            level = notes.level
            notes.setLevel(logging.ERROR)
            try:
                with warnings.catch_warnings(), plain_products():
                    warnings.simplefilter("ignore")
                    exported = torch.export.export(_Traced(self.loop, drafts, names), args, dynamic_shapes=dims,
                                                   strict=False)
            finally:
                notes.setLevel(level)
            torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=dict(self.options))
            return {"fixed": _fixed(exported)}

        # Inductor's check of the CPU's ISAs (a compiler probe per ISA, 1.3 s a process) decides only a warning
        # at load, where the store's directory names the ISA already
        os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
        try:
            path, built, info = step_store.package(key, build, describe=self._describe(drafts))
            self.fixed[drafts] = info["fixed"]
            program = torch._inductor.aoti_load_package(path)
        except Exception as e:  # no C++ compiler, an operator export cannot take, a package that does not load
            raise CompileFailed(f"{type(e).__name__}: {e}") from e
        self.keys.append(key)
        self.built += built
        self.loaded += not built
        self.seconds += time.perf_counter() - t0
        _SPENT[0] += time.perf_counter() - t0
        return program

    def _describe(self, drafts: bool) -> str:
        loop = self.loop
        cfg = loop.model.cfg
        return (f"{loop.drafter.name} step{' with drafts' if drafts else ''}: {cfg.dec_layers} decoder layers, "
                f"d_model {cfg.d_model}, vocabulary {cfg.tgt_vocab}, {next(loop.model.parameters()).dtype}")


def _loop_key(loop: Any) -> str:
    """What a loop's programs depend on besides their input shapes: the model's configuration and tensors
    (names, shapes, dtypes, bytes: frozen into the program); the loop's plain settings (its Python values are
    constants of the program: the attention it takes, the batch size its products were chosen for, the
    length rules) and dtypes; the drafter's class and plain settings; the acceptance rule; the forced tokens
    and start; aggdec's sources; the thread count (Inductor generates its parallel loops for it)."""
    plain = (bool, int, float, str, type(None))
    h = hashlib.sha256()
    for name, t in (*loop.model.named_parameters(), *loop.model.named_buffers()):
        h.update(repr((name, t.dtype, tuple(t.shape))).encode())
        h.update(memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()))

    def settings(owner: object) -> list:
        return sorted((k, v) for k, v in vars(owner).items() if not k.startswith("_") and isinstance(v, plain))

    what = (repr(loop.model.cfg), h.hexdigest(), settings(loop), str(loop.dtype), str(loop.cache_dtype),
            type(loop.drafter).__qualname__, settings(loop.drafter), loop.acceptance.describe(), loop.forced.tolist(),
            loop.starts.tolist(), step_store.sources(), torch.get_num_threads())
    return hashlib.sha256(repr(what).encode()).hexdigest()


def _fixed(exported: torch.export.ExportedProgram) -> list[list[int]]:
    """The sizes of `exported`'s inputs (user inputs, in order; not the weights), as [input, dimension, size,
    1] where it fixed them (an AOTInductor program does not check them: an input of another size runs,
    wrongly) and [input, dimension, least size, 0] where they are symbolic."""
    signature = exported.graph_signature
    users = [spec.arg.name for spec in signature.input_specs if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    values = {node.name: node.meta["val"] for node in exported.graph.find_nodes(op="placeholder")}
    sizes = []
    for i, name in enumerate(users):
        for d, size in enumerate(values[name].shape):
            expr = size.node.expr if isinstance(size, torch.SymInt) else size
            if getattr(expr, "is_number", True):
                sizes.append([i, d, int(expr), 1])
            else:
                bound = exported.range_constraints.get(expr)
                sizes.append([i, d, int(bound.lower) if bound is not None else 0, 0])
    return sizes


def _check(sizes: list[list[int]], args: tuple) -> None:
    """Raise CompileFailed where `args` differ from a program's `sizes` (`_fixed`)."""
    for i, d, size, fixed in sizes:
        have = args[i].shape[d]
        if have != size if fixed else have < size:
            raise CompileFailed(f"input {i} has {have} at dimension {d}, where the program takes "
                                f"{size if fixed else f'at least {size}'}")


class CompileFailed(RuntimeError):
    """Exporting, compiling or loading a step's program failed (before it ran)."""


def refused(model: torch.nn.Module) -> str | None:
    """Why `model`'s steps do not compile (one line), or None: an int8 verifier (its products are aggdec's
    own operator), or ATen's ISA lowered below this CPU's own by ATEN_CPU_CAPABILITY, where TorchInductor
    generates code that decodes wrongly (torch 2.13 on an AMX Xeon under `ATEN_CPU_CAPABILITY=avx2`:
    every output of a 16-slot greedy step empty)."""
    if getattr(model, "output_int8", None) is not None:
        return "an int8 verifier's steps run eagerly"
    return lowered_isa()


ISA_ORDER = ("DEFAULT", "AVX2", "AVX512")
"""ATen's CPU capabilities on x86, lowest first."""


def lowered_isa() -> str | None:
    """One line where ATEN_CPU_CAPABILITY lowers ATen's capability below this CPU's own, else None."""
    import os

    caps = torch.cpu.get_capabilities()
    have = torch.backends.cpu.get_cpu_capability()
    own = ("AVX512" if all(caps.get(f"avx512_{x}") for x in ("f", "bw", "vl", "dq")) else
           "AVX2" if caps.get("avx2") else "DEFAULT")
    if have in ISA_ORDER and ISA_ORDER.index(have) < ISA_ORDER.index(own):
        return (f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '')} lowers ATen to {have} on a CPU "
                f"with {own}, where a compiled step decodes wrongly")
    return None
