"""Where TorchInductor keeps what aggdec compiles, and how long a process waits for another one's
compile: `prepare` (both, before a compile is set up).

What aggdec compiles at run time is TorchInductor's (a compiled slot-loop step, `compile = true`;
int8 products). Inductor (torch 2.13: `_inductor/codecache.py`, `cpp_builder.py`, `cpu_vec_isa.py`)
takes a `filelock` lock per program in its cache (`TORCHINDUCTOR_CACHE_DIR`, `locks/`) while it
builds it. Those are `flock` locks, which the operating system releases when their owner dies: a
compile killed midway (SIGKILL, an actor stopped) holds nobody up, and the next process takes the
lock over. A live owner, another process compiling the same program, is waited for up to
`torch._inductor.codecache.LOCK_TIMEOUT` (TORCHINDUCTOR_FILE_LOCK_TIMEOUT, 600 s by default), after
which the compile fails (the slot loop then decodes eagerly, int8 products run op by op).

Inductor's cache of compiled graphs is not keyed by the vector instruction set it generated code
for: a program generated for AVX-512 (16 floats a vector) and found again by a process whose ISA is
AVX2 (`ATEN_CPU_CAPABILITY=avx2`, or a cache directory shared by machines of two CPU classes) is
rebuilt from its AVX-512 source with AVX2's flags and computes garbage in its vectors' tails
(measured with torch 2.13 on an AMX Xeon: int8 products and compiled steps wrong, every test of
them failing). `cache_per_isa` gives each ISA a directory of its own.

A compiled slot-loop step is compiled once per machine, not once per process (`compile_step`,
`stored`). Inductor's own caches do not serve it: with `freezing` its FX graph cache is bypassed
(the frozen weights are packed as mkldnn tensors, which do not pickle) and so is AOTAutograd's
("Cannot cache a graph with freezing enabled"), and even a hit there would leave TorchDynamo's and
AOTAutograd's tracing to every process. Each graph TorchDynamo captures is compiled instead by
AOTInductor into a package that holds its program and its frozen weights, and later processes load
that package after tracing (no AOTAutograd, no Inductor, no C++ compiler). Packages live in
`<base>/aggdec-steps/torch-<version>/<cpu>/<key>.pt2`, `<base>` being TORCHINDUCTOR_CACHE_DIR, or
Inductor's default (`/tmp/torchinductor_<user>`), as first found in the process (`store_dir`). A
package's key digests everything its program depends on: the graph's code and input shapes, the
bytes of every tensor the graph holds (the weights, frozen into the package as constants: two models
of the same shapes have the same graph, and one loading the other's package decodes with the other's
weights, measured; Inductor's FX graph cache keys a frozen weight by shape and dtype alone, taking
its values from the running graph), the Inductor options and configuration, the thread count; the
directory names torch's version and the CPU's vector features. A package is written whole
(renamed into place); builders of the same key take a lock in Inductor's lock directory, waited for
at most `LOCK_TIMEOUT_S` like Inductor's own and released by the operating system when its owner dies.
Recorded steps (`compile_step`'s `replay`, `replays/<key>/`) let later processes run a package without
TorchDynamo. Beside the packages, `warm/<key>` files mark the loops whose programs the store holds (`mark_warm`,
`steps_key`), and `rates/<key>` the seconds a request of such a loop took here, eager and compiled
(`record_rate`): `compile = "auto"` asks them where they decide whether compiling pays.
"""

from __future__ import annotations

import functools
import getpass
import hashlib
import inspect
import itertools
import json
import logging
import operator
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aggdec.thresholds import CPP_GEMM_SLOTS

if TYPE_CHECKING:
    import torch

LOCK_TIMEOUT_S = 60
"""The longest wait for another process's lock on a program, unless TORCHINDUCTOR_FILE_LOCK_TIMEOUT is set."""
_WAIT_RECORD = "Lock %s not acquired on %s, waiting %s seconds ..."  # filelock's debug record while it polls


ISA_ORDER = ("DEFAULT", "AVX2", "AVX512")
"""ATen's CPU capabilities on x86, lowest first."""


def lowered_isa() -> str | None:
    """One line where ATEN_CPU_CAPABILITY lowers ATen's capability below this CPU's own (AVX2 on a
    CPU with AVX-512, DEFAULT on one with AVX2), else None. There a TorchInductor-compiled decoder
    step decodes wrongly (torch 2.13, measured on an AMX Xeon under `ATEN_CPU_CAPABILITY=avx2`: every
    output of a 16-slot greedy step empty, with or without ONEDNN_MAX_CPU_ISA=AVX2 and a fresh
    cache), while each CPU class at its own capability decodes right: the slot loop decodes eagerly."""
    import torch

    have = torch.backends.cpu.get_cpu_capability()
    own = "AVX512" if torch.cpu._is_avx512_supported() else "AVX2" if torch.cpu._is_avx2_supported() else "DEFAULT"
    if have in ISA_ORDER and ISA_ORDER.index(have) < ISA_ORDER.index(own):
        return f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '')} lowers ATen to {have} on a CPU with {own}"
    return None


_BASE: list[str] = []  # the cache directory as first found in this process, before `cache_per_isa`


def _base() -> str:
    """TORCHINDUCTOR_CACHE_DIR, or Inductor's default cache directory (torch 2.13: `default_cache_dir`,
    whose module imports all of TorchInductor and TorchDynamo, 2 s), as first found in this process."""
    if not _BASE:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
        default = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
        _BASE.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default)
    return _BASE[0]


def prepare(timeout_s: float = LOCK_TIMEOUT_S) -> None:
    """`cache_per_isa` and `bound_locks`: call where a compile is set up, before it runs."""
    cache_per_isa()
    bound_locks(timeout_s)


def cache_per_isa() -> str:
    """Point TorchInductor's cache (TORCHINDUCTOR_CACHE_DIR, or its default) at a subdirectory named
    for the vector ISA Inductor generates code for in this process (`pick_vec_isa`, which follows
    ATEN_CPU_CAPABILITY) and return it. Programs compiled before the first call stay where they are."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = "-".join(str(pick_vec_isa()).split()) or "novec"
    path = os.path.join(_base(), f"isa-{isa}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def bound_locks(timeout_s: float = LOCK_TIMEOUT_S) -> None:
    """Lower TorchInductor's wait for a lock that another live process holds to `timeout_s` (where
    TORCHINDUCTOR_FILE_LOCK_TIMEOUT does not set it), and have the first wait on each of its lock
    files say so in one warning: which file, for how long at most. Call where a compile is set up,
    before it runs; calling again changes only the bound."""
    import torch._inductor.codecache as codecache
    import torch._inductor.config as config

    if "TORCHINDUCTOR_FILE_LOCK_TIMEOUT" not in os.environ:
        # the modules that lock read codecache.LOCK_TIMEOUT when they lock, codecache's own copy of the config
        codecache.LOCK_TIMEOUT = config.file_lock_timeout = timeout_s
    logger = logging.getLogger("filelock")
    if not any(isinstance(f, _SayWaits) for f in logger.filters):
        logger.addFilter(_SayWaits(logger.getEffectiveLevel(), codecache.get_lock_dir()))
        logger.setLevel(logging.DEBUG)  # its records while it polls reach the filter, which drops them


class _SayWaits(logging.Filter):
    """On the `filelock` logger, enabled for its debug records: turns the first "not acquired" record
    of each lock file in `lock_dir` into a warning and passes on only the records the logger's
    former `level` let through."""

    def __init__(self, level: int, lock_dir: str):
        super().__init__()
        self.level, self.lock_dir, self.said = level, os.path.realpath(lock_dir), set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _WAIT_RECORD and len(record.args) == 3:
            path = os.path.realpath(str(record.args[1]))
            if os.path.dirname(path) == self.lock_dir and path not in self.said:
                self.said.add(path)
                from torch._inductor.codecache import LOCK_TIMEOUT

                warnings.warn(f"aggdec: waiting (at most {LOCK_TIMEOUT:g} s) for {path}: another process is "
                              "compiling the same TorchInductor program", stacklevel=2)
        return record.levelno >= self.level


_SECONDS = [0.0]  # compile_seconds
COUNTS = {"built": 0, "loaded": 0, "replayed": 0}
"""Programs this process built (`_build`) and loaded from the store (`_load`), and calls of `compile_step`
functions that ran a recorded program without TorchDynamo (`replayed`)."""


def compile_seconds() -> float:
    """Seconds this process spent compiling decoder programs: the calls of functions `compile_step` made
    during which TorchDynamo compiled a frame (traced a graph, had `stored` load or build its program;
    a compile that failed too), each with the one run of the program within it (milliseconds), and the
    loading of recorded programs (`compile_step`'s `replay`)."""
    return _SECONDS[0]


def steps_built() -> int:
    """Programs this process built so far, not loaded from the store (`stored`)."""
    return COUNTS["built"]


def step_options(dtype: torch.dtype, slots: int, drafts: bool) -> dict[str, Any]:
    """TorchInductor options of a compiled CPU slot-loop step (symbolic shapes): a C++ wrapper; no guards on
    the model's modules; the weights frozen into the program as constants; products by Inductor's C++
    template for fp32 steps of at most `CPP_GEMM_SLOTS` slots, else by ATen's, as in a step that verifies
    `drafts` or several tokens a position (a double-token model's; for their products the C++ template
    offered no choice: `NoValidChoicesError`)."""
    import torch

    gemm = "CPP" if dtype == torch.float32 and slots <= CPP_GEMM_SLOTS and not drafts else "ATEN"
    return {"cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            "freezing": True, "max_autotune": True, "max_autotune_gemm_backends": gemm}


def compile_step(fn: Callable[..., Any], options: dict[str, Any],
                 replay: Callable[[], str] | None = None) -> Callable[..., Any]:
    """`fn` (a bound method) compiled by TorchDynamo with symbolic shapes and Python floats specialized
    (as Inductor's own compile ends up with them, after a restart), each graph run as the AOTInductor
    package `stored` finds or builds with the Inductor `options` (`guard_filter_fn` among them goes to
    TorchDynamo); its calls that compile are counted in `compile_seconds`.

    `replay`: where given, `fn` returns None and acts only on tensors, and `replay()` is a key (`replay_key`)
    of everything its program depends on besides its inputs. A call that TorchDynamo traced whole into one
    graph without outputs (every effect in place on its inputs) is then recorded under the key
    (`replays/<key>/` in `store_dir`: the package and, for each input, where the frame holds it and what
    the program requires of it), and later calls, in any process, whose inputs a record finds as it
    requires run its package directly (`_Replay`): no TorchDynamo import (2 s), trace or guards."""
    state: dict[str, Any] = {}
    names = list(inspect.signature(fn).parameters)

    def replayed(*args) -> bool:
        if "records" not in state:
            t0 = time.perf_counter()
            state["dir"] = os.path.join(store_dir(), "replays", replay())
            state["records"] = _Replay.all(state["dir"])
            _SECONDS[0] += time.perf_counter() - t0
        frame = dict(zip(names, args), self=fn.__self__)
        for record in state["records"]:
            inputs = record.bind(frame)
            if inputs is not None:
                try:
                    record.loader.boxed_run(inputs)
                except RuntimeError as e:  # its program's own checks refused the inputs: TorchDynamo's turn
                    warnings.warn(f"aggdec: a recorded step refused its inputs ({e}); tracing it", stacklevel=3)
                    state["records"].remove(record)
                    return False
                COUNTS["replayed"] += 1
                return True
        return False

    def traced():
        """TorchDynamo's `fn`, its counters and Inductor's configuration, imported and made once."""
        if "compiled" not in state:
            import torch
            import torch._inductor.config as inductor_config
            from torch._dynamo.utils import counters

            pending = state["pending"] = []
            backend = functools.partial(stored, pending=pending if replay is not None else None)
            compiled = torch._dynamo.config.patch(specialize_float=True)(
                torch.compile(fn, dynamic=True, backend=backend, options=dict(options)))
            state.update(compiled=compiled, counters=counters, config=inductor_config)
        return state["compiled"], state["counters"], state["config"]

    def timed(*args, **kwargs):
        if replay is not None and not kwargs and replayed(*args):
            return None
        compiled, counters, inductor_config = traced()
        frames, graphs, t0 = counters["frames"]["total"], counters["stats"]["unique_graphs"], time.perf_counter()
        breaks = sum(counters["graph_break"].values())
        frozen = inductor_config.freezing  # TorchDynamo reads it from the global config when it traces
        inductor_config.freezing = True
        try:
            return compiled(*args, **kwargs)
        finally:
            inductor_config.freezing = frozen
            if counters["frames"]["total"] != frames:
                _SECONDS[0] += time.perf_counter() - t0
                whole = (counters["stats"]["unique_graphs"] == graphs + 1
                         and sum(counters["graph_break"].values()) == breaks and len(state["pending"]) == 1)
                if replay is not None and whole and "dir" in state:
                    record = state["pending"][0]
                    record["fixed"] = [f"L[{name!r}] == {value!r}" for name, value in zip(names, args)
                                       if isinstance(value, int) and f"L[{name!r}]" not in record["sources"]]
                    state["records"] += filter(None, [_Replay.write(state["dir"], record)])
            state["pending"].clear()

    return timed


class _Replay:
    """A recorded program (`compile_step`'s `replay`): its package's loader; its inputs as the expressions
    of TorchDynamo's sources (L: the frame's arguments, `self` among them); what the program requires of
    each (a tensor's dtype, its fixed sizes and strides, an integer's value where fixed); TorchDynamo's
    guards on sizes and integers (`ShapeEnv.produce_guards`); and the values of the frame's integer
    arguments that the graph does not take ("fixed": TorchDynamo specialized them). Tensors, and the
    guards on their sizes alone, are checked where they are other objects than at the last call that ran
    (a loop's buffers stay the same objects between allocations); integers and the guards that read
    them, at every call."""

    def __init__(self, record: dict[str, Any], loader):
        self.loader, self.needs = loader, record["inputs"]
        self.ints_at = [i for i, need in enumerate(self.needs) if need[0] == "int"]
        self.tensors_at = [i for i, need in enumerate(self.needs) if need[0] == "tensor"]
        ints = [record["sources"][i] for i in self.ints_at]
        every = [g for g in record["guards"] if any(s in g for s in ints)]
        sizes = [g for g in record["guards"] if g not in every]
        every += record["fixed"] + [f"{record['sources'][i]} == {self.needs[i][1]}" for i in self.ints_at
                                    if self.needs[i][1] is not None]
        # the store is trusted: it holds the programs this process runs
        self.find = eval(f"lambda L: ({''.join(s + ', ' for s in record['sources'])})", {})
        self.every = eval(f"lambda L: {' and '.join(f'({g})' for g in every) or 'True'}", {})
        self.sizes = eval(f"lambda L: {' and '.join(f'({g})' for g in sizes) or 'True'}", {})
        self.seen: list = []

    @classmethod
    def loaded(cls, directory: str, record: dict[str, Any]) -> "_Replay | None":
        """`record`, kept in `directory` (`replays/<key>` in the store), with its package loaded; None where
        the package does not load."""
        program = _load(os.path.join(os.path.dirname(os.path.dirname(directory)), record["package"]))
        return None if program is None else cls(record, program[0])

    @classmethod
    def all(cls, directory: str) -> list["_Replay"]:
        """The records in `directory` whose package loads."""
        found = []
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
            try:
                with open(os.path.join(directory, name)) as f:
                    found.append(cls.loaded(directory, json.load(f)))
            except (OSError, ValueError, KeyError):
                continue
        return [r for r in found if r is not None]

    @classmethod
    def write(cls, directory: str, record: dict[str, Any]) -> "_Replay | None":
        """Record `record` (written whole), unless the store is not writable, and return it loaded."""
        path = os.path.join(directory, record["package"].replace(".pt2", ".json"))
        try:
            os.makedirs(directory, exist_ok=True)
            with open(f"{path}.{os.getpid()}", "w") as f:
                json.dump(record, f)
            os.replace(f"{path}.{os.getpid()}", path)
        except OSError:
            pass
        return cls.loaded(directory, record)

    def bind(self, frame: dict[str, Any]) -> list | None:
        """The program's inputs from `frame` (integers carried as sizes, `_carrier`), or None where they
        are not as it requires."""
        try:
            if not self.every(frame):
                return None
            values = list(self.find(frame))
            tensors = [values[i] for i in self.tensors_at]
            if len(tensors) != len(self.seen) or not all(map(operator.is_, tensors, self.seen)):
                if not all(_fits(values[i], self.needs[i]) for i in self.tensors_at) or not self.sizes(frame):
                    return None
                self.seen = tensors
            for i in self.ints_at:
                values[i] = _carried(values[i])
        except (AttributeError, KeyError, IndexError, TypeError):
            return None
        return values


@functools.lru_cache(maxsize=4096)
def _carried(n: int):
    """`_carrier(n)`, one tensor for each integer (a program reads only its size)."""
    return _carrier(n)


def _fits(value: Any, need: list) -> bool:
    """Whether `value` is a CPU tensor as a record's `need` ("tensor", dtype, sizes, strides) requires."""
    import torch

    return (isinstance(value, torch.Tensor) and str(value.dtype) == need[1] and value.device.type == "cpu"
            and value.dim() == len(need[2]) and all(n in (None, d) for n, d in zip(need[2], value.shape))
            and all(n in (None, d) for n, d in zip(need[3], value.stride())))


def replay_key(model: torch.nn.Module, *settings: Any) -> str:
    """A key for `compile_step`'s `replay`: `steps_key` of `model` and of `settings` (each an object's type
    and its public attributes of plain types, or a value without attributes), with a digest of the
    weights of the modules the settings hold (a drafter's) and of aggdec's own sources."""
    import torch

    plain, h = (bool, int, float, str, type(None), torch.dtype), hashlib.sha256()

    def described(value: Any) -> Any:
        if not hasattr(value, "__dict__"):
            return value
        for name, module in vars(value).items():  # a drafter's own weights
            if isinstance(module, torch.nn.Module) and module is not model:
                for key, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
                    _digest(h, f"{name}.{key}", tensor)
        return type(value).__qualname__, sorted((k, v) for k, v in vars(value).items()
                                                if not k.startswith("_") and isinstance(v, plain))

    return steps_key(model, repr(([described(s) for s in settings], h.hexdigest(), _sources())))


@functools.cache
def _sources() -> str:
    """A digest of aggdec's own sources (.py, .cpp), once a process."""
    h = hashlib.sha256()
    for folder, _, files in sorted(os.walk(os.path.dirname(os.path.abspath(__file__)))):
        for name in sorted(f for f in files if f.endswith((".py", ".cpp"))):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def steps_key(model: torch.nn.Module, settings: str) -> str:
    """A digest of what a loop's compiled programs depend on besides their graphs: every tensor of `model`
    (name, dtype, shape, bytes), `settings` (the caller's: the options, what it compiles) and the thread
    count: the key of `warm`'s marker (hashing `ende-base`'s 7.3 M weights takes about 25 ms)."""
    import torch

    h = hashlib.sha256(f"{settings}|threads {torch.get_num_threads()}".encode())
    for name, value in itertools.chain(model.named_parameters(), model.named_buffers()):
        _digest(h, name, value)
    return h.hexdigest()


def warm(key: str) -> bool:
    """Whether `mark_warm(key)` was called on this machine (in `store_dir`, so for this torch and CPU
    class): the store then holds the programs of the loop `key` names, unless a later change of Inductor's
    configuration keys them anew (they are then compiled again, as without the marker)."""
    return os.path.exists(os.path.join(store_dir(), "warm", key))


def mark_warm(key: str) -> None:
    """Record (an empty file in `store_dir`/warm) that the store holds the programs of the loop `key` names
    (`steps_key`): call after such a loop decoded compiled. Where the store is not writable (programs
    loaded from a shared one), nothing is recorded."""
    path = os.path.join(store_dir(), "warm", key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a"):
            pass
    except OSError:
        pass


def rates(key: str) -> dict[str, float]:
    """Seconds a request took on this machine (in `store_dir`), as `record_rate` last recorded them for the
    loop `key` names (`steps_key`), by backend ("eager", "compiled"), and the seconds compiling its step
    took ("build") or loading it from the store ("load"); {} where none was recorded."""
    try:
        with open(os.path.join(store_dir(), "rates", key)) as f:
            return {k: float(v) for k, v in json.load(f).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def record_rate(key: str, what: str, seconds: float) -> None:
    """Record the `seconds` a request of the loop `key` names took decoding by backend `what` ("eager",
    "compiled"), or building or loading its step ("build", "load"), beside the others (`rates`); written
    whole (renamed into place), nothing where the store is not writable."""
    path = os.path.join(store_dir(), "rates", key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        part = f"{path}.{os.getpid()}"
        with open(part, "w") as f:
            json.dump({**rates(key), what: seconds}, f)
        os.replace(part, path)
    except OSError:
        pass


def store_dir() -> str:
    """Where compiled steps are kept: `<base>/aggdec-steps/torch-<version>/<cpu>` (module docstring), <cpu>
    naming ATen's vector capability and a digest of the CPU's instruction-set features."""
    import torch

    caps = torch.cpu.get_capabilities()
    features = hashlib.sha256(",".join(sorted(k for k, v in caps.items() if v is True)).encode()).hexdigest()
    cpu = f"{caps.get('architecture', 'cpu')}-{torch.backends.cpu.get_cpu_capability()}-{features[:12]}"
    return os.path.join(_base(), "aggdec-steps", f"torch-{torch.__version__}", cpu)


def stored(gm: torch.fx.GraphModule, example_inputs: list, options: dict[str, Any] | None = None,
           pending: list | None = None) -> Callable[..., Any]:
    """TorchDynamo backend: `gm` as the AOTInductor package of its key (module docstring) in `store_dir`,
    loaded if there, else built with Inductor `options` (`prepare` first) while holding the key's lock,
    every tensor `gm` holds (the weights, where TorchDynamo traced under `freezing`) in the package. Its
    integer inputs reach the program as the sizes of empty tensors (AOTInductor takes tensors only).
    Where `gm` has no outputs, a record of it for `compile_step`'s `replay` is appended to `pending`.
    Raises what the build raises, and filelock's `Timeout` after `LOCK_TIMEOUT` s waiting for another
    builder."""
    import torch
    import torch.utils._pytree as pytree

    options = dict(options or {})
    placeholders = gm.graph.find_nodes(op="placeholder")
    inputs = [node.meta["example_value"] for node in placeholders]
    ints = [not isinstance(v, torch.Tensor) for v in inputs]
    path = os.path.join(store_dir(), f"{_key(gm, inputs, options)}.pt2")
    program = _load(path)
    if program is None:
        from torch._inductor import codecache
        from torch.utils._filelock import FileLock

        prepare()
        with FileLock(os.path.join(codecache.get_lock_dir(), os.path.basename(path) + ".lock"),
                      timeout=codecache.LOCK_TIMEOUT):
            program = _load(path) or _build(gm, example_inputs, inputs, ints, options, path)
    if program is None:
        raise RuntimeError(f"the program compiled into {path} does not load")
    loader, out_spec = program
    if pending is not None and not gm.graph.find_nodes(op="output")[0].args[0]:
        sources = [getattr(node.meta.get("grapharg"), "source", None) for node in placeholders]
        env = getattr(torch._guards.detect_fake_mode(inputs), "shape_env", None)
        if all(sources) and env is not None:
            pending.append({"package": os.path.basename(path), "inputs": [_needs(v) for v in inputs],
                            "sources": [source.name for source in sources],
                            "guards": env.produce_guards(inputs, sources)})  # TorchDynamo's on sizes and integers

    def run(*args):
        return pytree.tree_unflatten(loader.boxed_run([_carried(a) if i else a for a, i in zip(args, ints)]), out_spec)

    return run


def _symbolic(size) -> bool:
    """Whether TorchDynamo's `size` (an int, a SymInt) is symbolic, not fixed."""
    import torch

    return isinstance(size, torch.SymInt) and not size.node.shape_env.simplify(size.node.expr).is_number


def _needs(value) -> list:
    """What a recorded program requires of an input whose example is `value` (`_Replay`)."""
    import torch

    if not isinstance(value, torch.Tensor):
        return ["int", None if _symbolic(value) else int(value)]
    fixed = [[None if _symbolic(n) else int(n) for n in sizes] for sizes in (value.shape, value.stride())]
    return ["tensor", str(value.dtype), *fixed]


def _carrier(n: int):
    """An integer as an empty tensor's first size, shifted by 2 (export specializes sizes 0 and 1)."""
    import torch

    return torch.empty((n + 2, 0), dtype=torch.uint8)


def _key(gm: torch.fx.GraphModule, inputs: list, options: dict[str, Any]) -> str:
    """A digest of what `gm`'s program depends on: its code (and its subgraphs'), its inputs' dtypes,
    shapes and strides, the bytes of every tensor it reads as an attribute (frozen weights), `options`,
    Inductor's configuration and the thread count its parallel loops are generated for."""
    import torch
    import torch._inductor.config as config

    h = hashlib.sha256()
    h.update(repr([(v.dtype, v.shape, v.stride()) if isinstance(v, torch.Tensor) else v for v in inputs]).encode())
    h.update(repr((sorted(options.items()), sorted(config.save_config_portable().items()))).encode())
    h.update(str(torch.get_num_threads()).encode())
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            h.update(module.code.encode())
            for node in module.graph.find_nodes(op="get_attr"):
                value = torch.fx.graph_module._get_attr(module, node.target)
                if isinstance(value, torch.Tensor):
                    _digest(h, node.target, value)
    return h.hexdigest()


def _digest(h: Any, name: str, value: torch.Tensor) -> None:
    """Add a named tensor to the hash `h`: its name, dtype, shape and bytes."""
    import torch

    h.update(repr((name, value.dtype, value.shape)).encode())
    h.update(memoryview(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy()))


def _load(path: str):
    """The package at `path` as (its loader, its outputs' tree spec), or None where there is none or it
    does not load. Loaded as torch's `aoti_load_package` does, without its check of the CPU, whose
    `pick_vec_isa` takes seconds (builds and loads a probe per vector ISA) and which `store_dir` has made.
    Counts `COUNTS["loaded"]`."""
    import torch
    import torch.utils._pytree as pytree

    if not os.path.exists(path):
        return None
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
    except Exception as e:  # a package from an interrupted copy, a library that changed: rebuilt
        warnings.warn(f"aggdec: {path} did not load ({type(e).__name__}: {e}), compiling it again", stacklevel=2)
        return None
    COUNTS["loaded"] += 1
    return loader, pytree.treespec_loads(loader.get_call_spec()[1])


def _build(gm: torch.fx.GraphModule, example_inputs: list, inputs: list, ints: list[bool], options: dict[str, Any],
           path: str):
    """Export `gm` (integers carried as tensor sizes, `_shapes`), compile it with AOTInductor into a
    file beside `path`, rename that into place and load it. Counts `COUNTS["built"]`."""
    import torch
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

    class Carried(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gm = gm

        def forward(self, *args):
            return self.gm(*[a.shape[0] - 2 if i else a for a, i in zip(args, ints)])

    args = tuple(_carrier(guarding_hint_or_throw(a)) if i else a for a, i in zip(example_inputs, ints))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = f"{path[:-4]}.{os.getpid()}.pt2"
    try:
        with torch._guards.tracing(None):  # a trace and a compile of their own, outside TorchDynamo's
            program = torch.export.export(Carried(), args, dynamic_shapes=(_shapes(inputs),), strict=False,
                                          prefer_deferred_runtime_asserts_over_guards=True)
            torch._inductor.aoti_compile_and_package(program, package_path=part, inductor_configs=dict(options))
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.remove(part)
    COUNTS["built"] += 1
    return _load(path)


def _shapes(inputs: list) -> tuple:
    """torch.export's dynamic shapes for TorchDynamo's graph inputs `inputs` (their example values), each
    integer carried as a size (`_carrier`): `Dim.DYNAMIC` where TorchDynamo's size is symbolic (export
    fails rather than fix it), fixed where TorchDynamo fixed it. Sizes get symbols of their own (no
    duck sizing), related only as the graph's operations relate them."""
    import torch
    from torch.export import Dim

    return tuple(({i: Dim.DYNAMIC for i, s in enumerate(v.shape) if _symbolic(s)} if isinstance(v, torch.Tensor)
                  else {0: Dim.DYNAMIC} if _symbolic(v) else None) or None for v in inputs)
