"""aggdec's store of compiled decoder steps, and what compiling measured on this machine.

A compiled slot-loop step (aggdec.decoding.compiled_step) is built once per machine: its AOTInductor
package is kept here and loaded by every later process. Packages hold code alone (the loading model
supplies the weights), so a package serves every model of the same architecture and shapes.

Layout: `<base>/steps/torch-<version>/<cpu>/` with `<key>.pt2` (a package), `<key>.json` (what it is)
and `rates/<key>` (the seconds a request took here, eager and compiled, and what loading or building a
loop's programs took: `record_rate`, read by `compile = "auto"`). `<base>` is AGGDEC_CACHE_DIR, else
`$XDG_CACHE_HOME/aggdec`, else `~/.cache/aggdec`; `<cpu>` names ATen's vector capability and the CPU's
features, since a program is generated for them.

The store is bounded: after each package it writes, the least recently used packages (loading one
counts as a use) go until the packages take at most AGGDEC_CACHE_MAX_MB (default `MAX_MB`).
`aggdec cache list` and `aggdec cache clear` show and empty it (and `<base>/inductor`, TorchInductor's
cache where TORCHINDUCTOR_CACHE_DIR does not set one, which building leaves files in). Builders of one key take a lock on it
(`filelock`, released by the operating system when its owner dies): the second waits, then loads.
Packages are written whole (renamed into place). Nothing here imports more of torch than its version.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_MB = 2048
"""The store's default bound on its packages, in MB (AGGDEC_CACHE_MAX_MB sets another)."""

LOCK_TIMEOUT_S = 600
"""The longest wait for another process building the same package; then this one builds it too."""


def base() -> str:
    """AGGDEC_CACHE_DIR, else `$XDG_CACHE_HOME/aggdec`, else `~/.cache/aggdec`."""
    if os.environ.get("AGGDEC_CACHE_DIR"):
        return os.environ["AGGDEC_CACHE_DIR"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "aggdec")


def max_bytes() -> int:
    """The store's bound in bytes: AGGDEC_CACHE_MAX_MB, else `MAX_MB`."""
    return int(float(os.environ.get("AGGDEC_CACHE_MAX_MB") or MAX_MB) * 2**20)


def store_dir() -> str:
    """`<base>/steps/torch-<version>/<cpu>`: <cpu> names ATen's vector capability and a digest of the CPU's
    instruction-set features."""
    import torch

    caps = torch.cpu.get_capabilities()
    features = hashlib.sha256(",".join(sorted(k for k, v in caps.items() if v is True)).encode()).hexdigest()
    cpu = f"{caps.get('architecture', 'cpu')}-{torch.backends.cpu.get_cpu_capability()}-{features[:12]}"
    return os.path.join(base(), "steps", f"torch-{torch.__version__}", cpu)


_INDUCTOR: list[str] = []  # inductor_cache's directory, once a process


def inductor_cache() -> str:
    """Point TorchInductor's cache (TORCHINDUCTOR_CACHE_DIR, else `<base>/inductor`) at a subdirectory named
    for ATen's vector capability in this process, and return it; call before anything is compiled.
    Inductor's caches are not keyed by the ISA they generated code for: a program generated for AVX-512
    and found by a process at AVX2 (`ATEN_CPU_CAPABILITY=avx2`, or a directory shared by two CPU classes)
    is rebuilt with AVX2's flags and computes garbage (torch 2.13, measured)."""
    if not _INDUCTOR:
        import torch

        root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or inductor_dir()
        _INDUCTOR.append(os.path.join(root, f"isa-{torch.backends.cpu.get_cpu_capability()}"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR[0]
    return _INDUCTOR[0]


@functools.cache
def sources() -> str:
    """A digest of aggdec's own sources (.py, .cpp), once a process: a program depends on them."""
    h = hashlib.sha256()
    for folder, _, files in sorted(os.walk(os.path.dirname(os.path.abspath(__file__)))):
        for name in sorted(f for f in files if f.endswith((".py", ".cpp"))):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def package(key: str, build: Callable[[str], dict], describe: str = "") -> tuple[str, bool, dict]:
    """The path of the package `key`, whether this call built it, and what its build said of it: found in
    the store (marked used), or built by `build(path)` at a path of its own (returning what to keep of it),
    renamed into place with that and a description beside it, the store then trimmed to its bound (`trim`).
    Raises what `build` raises."""
    import filelock

    directory = store_dir()
    path = os.path.join(directory, f"{key}.pt2")
    if _use(path):
        return path, False, _read_json(f"{path[:-4]}.json").get("program", {})
    os.makedirs(directory, exist_ok=True)
    try:
        lock = filelock.FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except filelock.Timeout:
        lock = None
    try:
        if _use(path):
            return path, False, _read_json(f"{path[:-4]}.json").get("program", {})
        part = f"{path[:-4]}.{os.getpid()}.pt2"
        try:
            program = build(part)
            _write_json(f"{path[:-4]}.json", {"what": describe, "built": time.time(), "program": program})
            os.replace(part, path)
        finally:
            if os.path.exists(part):
                os.remove(part)
    finally:
        if lock is not None:
            lock.release()
    trim(max_bytes(), keep=path)
    return path, True, program


def _use(path: str) -> bool:
    """Whether the package at `path` exists; if so, marked as used now (its time of last use)."""
    try:
        os.utime(path)
        return True
    except OSError:
        return False


@dataclass
class Entry:
    """A package in the store: its key, size in bytes, time of last use (seconds since the epoch) and what
    it holds."""

    key: str
    size: int
    used: float
    what: str


def entries() -> list[Entry]:
    """The store's packages (for this torch and CPU), most recently used first."""
    directory = store_dir()
    found = []
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name.endswith(".pt2") and name.count(".") == 1:
            stat = os.stat(os.path.join(directory, name))
            what = _read_json(os.path.join(directory, name[:-4] + ".json")).get("what", "")
            found.append(Entry(name[:-4], stat.st_size, stat.st_mtime, what))
    return sorted(found, key=lambda e: e.used, reverse=True)


def trim(limit: int, keep: str | None = None) -> list[Entry]:
    """Remove the least recently used packages until the rest take at most `limit` bytes (the package at
    `keep` stays); returns those removed."""
    removed, total, directory = [], 0, store_dir()
    for entry in entries():
        total += entry.size
        path = os.path.join(directory, f"{entry.key}.pt2")
        if total > limit and path != keep:
            for suffix in (".pt2", ".json", ".pt2.lock"):
                _remove(os.path.join(directory, entry.key + suffix))
            total -= entry.size
            removed.append(entry)
    return removed


def inductor_dir() -> str:
    """Where aggdec keeps TorchInductor's own cache where TORCHINDUCTOR_CACHE_DIR does not say (`inductor_cache`):
    what building packages leaves there is not needed to load them."""
    return os.path.join(base(), "inductor")


def size(path: str) -> int:
    """The bytes of the files under `path`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def clear() -> int:
    """Empty the store (every torch version's and CPU's packages and rates) and `inductor_dir`; returns the
    bytes freed."""
    freed = 0
    for root in (os.path.join(base(), "steps"), inductor_dir()):
        freed += size(root)
        shutil.rmtree(root, ignore_errors=True)
    return freed


def rates(key: str) -> dict[str, float]:
    """What `record_rate` recorded for the loops `key` names: seconds a request took by backend ("eager",
    "compiled"), and the seconds building ("build") or loading ("load") their programs took; {} if none."""
    found = _read_json(os.path.join(store_dir(), "rates", key))
    return {k: float(v) for k, v in found.items() if isinstance(v, (int, float))}


def record_rate(key: str, what: str, seconds: float) -> None:
    """Record `seconds` as `what` for the loops `key` names, beside the others (`rates`)."""
    path = os.path.join(store_dir(), "rates", key)
    _write_json(path, {**_read_json(path), what: seconds})


def record_packages(key: str, packages: list[str]) -> None:
    """Record that the loops `key` names run the packages `packages` (keys, as `package` takes them)."""
    path = os.path.join(store_dir(), "rates", key)
    _write_json(path, {**_read_json(path), "packages": sorted(packages)})


def stored(key: str) -> bool:
    """Whether the store holds every package recorded for the loops `key` names (`record_packages`)."""
    packages = _read_json(os.path.join(store_dir(), "rates", key)).get("packages")
    return bool(packages) and all(os.path.exists(os.path.join(store_dir(), f"{p}.pt2")) for p in packages)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: str, value: dict) -> None:
    """Written whole (renamed into place); nothing where the store is not writable."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        part = f"{path}.{os.getpid()}"
        with open(part, "w") as f:
            json.dump(value, f)
        os.replace(part, path)
    except OSError:
        pass


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
