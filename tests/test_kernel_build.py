"""The CPU decode-attention kernel is built when the package is installed (setup.py) and only loaded
at run time; what TorchInductor compiles at run time never leaves a process waiting without bound.
Each check runs in processes of its own: a process loads one of the kernel's libraries, and the
environment (compilers, caches, ATEN_CPU_CAPABILITY) is the process's."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

DECODE = """
import sys
from aggdec.model import decode_attention
from aggdec.decoding.drafters import NoDraft
from aggdec.decoding.metadata import Request
from aggdec.decoding.slot_loop import SlotLoop
from tiny_models import naive_greedy, tiny_model

model = tiny_model("prenorm-learned-separate", seed=1, vocab=9)
reqs = [Request(i, src + [model.cfg.eos], 10) for i, src in enumerate([[4, 5, 6], [7, 4], [5, 5, 6, 7, 8]])]
loop = SlotLoop(model, NoDraft(), max_batch_size=2, compile=sys.argv[1] == "compiled")
print("kernel", decode_attention.load(), "compiled", loop.compiled is not None, flush=True)
got = {h.index: h.tokens for h in loop.run(reqs)}
assert got == {r.index: naive_greedy(model, r.src, r.max_len) for r in reqs}, got
print("decoded", flush=True)
"""
"""A greedy decode of three sentences by a tiny float64 model (argv[1]: "eager" or "compiled"), checked
against greedy by recomputation; prints whether the kernel loaded and the step compiled."""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment with the repository's packages and the tests' tiny models importable, and
    TorchInductor's and torch's extension caches fresh in `tmp_path`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"),
               AGGDEC_CACHE_DIR=str(tmp_path / "aggdec"))
    env.pop("ATEN_CPU_CAPABILITY", None)
    return {**env, **extra}


def _decode(mode: str, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """DECODE in a process of its own; `cwd` is first on its path (`python -c`): not the repository's root
    where PYTHONPATH says which packages it imports."""
    return subprocess.run([sys.executable, "-c", DECODE, mode], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_a_decode_loads_the_kernel_without_a_compiler(tmp_path):
    """With no C++ compiler reachable (an empty PATH, CC and CXX /bin/false) and an empty extension
    cache, a decode loads the kernel and gives greedy's output: nothing is compiled at run time."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "extensions").mkdir()
    env = _env(tmp_path, PATH=str(tmp_path / "bin"), CC="/bin/false", CXX="/bin/false")
    done = _decode("eager", env, tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["kernel", "True", "compiled", "False", "decoded"], done.stdout + done.stderr
    assert "decode-attention" not in done.stderr
    assert not any((tmp_path / "extensions").iterdir())


def _copy_installed_from(tmp_path: Path, checkout: Path) -> dict[str, str]:
    """A copy of the package without its kernel libraries in `tmp_path` (as a job's working_dir is),
    first on the path of an environment where aggdec is installed editable from `checkout` (its
    dist-info, as pip writes it) -> that environment."""
    shutil.copytree(REPO / "aggdec", tmp_path / "aggdec", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    info = tmp_path / "aggdec-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: aggdec\nVersion: 0.1.0\n")
    (info / "direct_url.json").write_text(json.dumps({"dir_info": {"editable": True}, "url": checkout.as_uri()}))
    return _env(tmp_path, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO / "tests")]))


def test_a_missing_kernel_is_one_warning_and_masked_products(tmp_path):
    """The package installed without its kernel libraries built: `load` is False with one warning
    line that names the library and the command that builds it, and the decode still gives greedy's
    output (masked products)."""
    env = _copy_installed_from(tmp_path, tmp_path)
    done = _decode("eager", env, tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["kernel", "False", "compiled", "False", "decoded"], done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if "decode-attention" in line]
    assert len(lines) == 1 and "_decode_attention_" in lines[0] and "not built" in lines[0], done.stderr
    assert "pip install --no-build-isolation -e ." in lines[0]


def test_a_copy_without_the_libraries_loads_the_installed_ones(tmp_path):
    """A copy of the package without its libraries (a job's working_dir, uploaded without what git
    ignores) where aggdec is installed editable from this checkout: the kernel is this checkout's."""
    env = _copy_installed_from(tmp_path, REPO)
    script = ("import torch\nfrom aggdec.model import decode_attention\n"
              "print(decode_attention.load(), torch.backends.cpu.get_cpu_capability(), *torch.ops.loaded_libraries)")
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    from aggdec.model import decode_attention

    loaded, capability, *libraries = done.stdout.split()  # the child's capability: `_env` drops ATEN_CPU_CAPABILITY
    assert loaded == "True" and libraries == [str(decode_attention.library(capability))]


def _x86_with(capability: str) -> bool:
    order = ("DEFAULT", "AVX2", "AVX512")
    return (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability() in order[order.index(capability):])


@pytest.mark.parametrize("setting, capability", [("avx2", "AVX2"), ("default", "DEFAULT")])
def test_the_library_loaded_is_atens_capability(tmp_path, setting, capability):
    """ATEN_CPU_CAPABILITY lowers ATen's capability; the library `load` loads is the one built for
    that capability (AVX2's, or the portable one), and it computes the masked softmax's results."""
    if not _x86_with(capability):
        pytest.skip(f"this CPU has no {capability} capability")
    script = """
import torch
from aggdec.model import decode_attention
from aggdec.model.transformer import MultiheadAttention
assert decode_attention.load()
print(torch.backends.cpu.get_cpu_capability(), *torch.ops.loaded_libraries)
attn = MultiheadAttention(32, 2, 0.0).eval().double()
q, k, v = (torch.randn(3, n, 32, dtype=torch.float64) for n in (2, 9, 9))
count = torch.randint(1, 10, (3, 2))
keep = (torch.arange(9)[None, None, :] < count[:, :, None])[:, None]
with torch.no_grad():
    torch.testing.assert_close(decode_attention.attend(q, k, v, count, 2), attn.core(q, k, v, keep))
"""
    done = subprocess.run([sys.executable, "-c", script], env=_env(tmp_path, ATEN_CPU_CAPABILITY=setting), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    from aggdec.model import decode_attention

    assert done.stdout.split() == [capability, str(decode_attention.library(capability))]


def _held(lock: Path) -> bool:
    """Whether another process holds the `flock` lock on the file `lock` (taken and released at once if not)."""
    from filelock import FileLock, Timeout

    probe = FileLock(str(lock), timeout=0)
    try:
        probe.acquire()
    except Timeout:
        return True
    probe.release()
    return False


def _kill_while_compiling(env: dict[str, str], cwd: Path, *, lock: Path | None = None) -> Path | None:
    """Start a compiled decode and SIGKILL it, with the compiler processes it started, 5 s into its
    compile, or once it holds a lock of TorchInductor's in the directory `lock` (within 180 s): that
    lock file is returned. The decode must still be running when it is killed."""
    first = subprocess.Popen([sys.executable, "-c", DECODE, "compiled"], env=env, cwd=cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    held = None
    try:
        assert first.stdout.readline().split() == ["kernel", "True", "compiled", "True"]
        deadline = time.monotonic() + (180 if lock else 5)
        while held is None and time.monotonic() < deadline and first.poll() is None:
            held = next((path for path in (lock.rglob("*.lock") if lock else ()) if _held(path)), None)
            time.sleep(0.02)
        assert first.poll() is None, "the compiled decode ended before it could be killed"
        assert held or not lock, "no lock of TorchInductor's was held within 180 s"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL
    return held


def test_a_compile_killed_midway_does_not_stop_the_next_decode(tmp_path):
    """A compiled decode SIGKILLed 5 s into its compile (TorchInductor's cache and torch's extension
    cache fresh and shared) does not stop the next process from decoding within a bounded time."""
    env = _env(tmp_path)
    _kill_while_compiling(env, tmp_path)
    done = _decode("eager", env, tmp_path, timeout=60)
    assert done.returncode == 0 and done.stdout.split()[-1] == "decoded", done.stderr[-2000:]


@pytest.mark.slow
def test_a_compile_killed_midway_does_not_stop_the_next_compile(tmp_path):
    """A compiled decode SIGKILLed while it holds a lock of TorchInductor's (it builds a program
    there): the lock died with it (`flock`), and the next process compiling the same program decodes
    within a bounded time, without waiting on it (a compile here takes about a minute)."""
    env = _env(tmp_path)
    held = _kill_while_compiling(env, tmp_path, lock=tmp_path / "inductor")
    assert not _held(held)
    done = _decode("compiled", env, tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["kernel", "True", "compiled", "True", "decoded"], done.stdout + done.stderr
    assert "waiting" not in done.stderr




def test_setup_reads_the_kernel_modules_where_aggdec_is_not_installed(tmp_path):
    """setup.py reads the kernel modules' names on a machine where aggdec is not importable yet (a
    fresh `pip install -e .`): their own imports of aggdec resolve to the checkout."""
    script = f"""
import runpy, sys
from pathlib import Path
sys.path[:] = [p for p in sys.path if p and "__editable__" not in p and Path(p).resolve() != Path({str(REPO)!r})]
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
try:
    import aggdec
    sys.exit("aggdec is still importable from " + aggdec.__file__)
except ImportError:
    pass
sys.argv = ["setup.py", "--name"]
runpy.run_path({str(REPO / "setup.py")!r}, run_name="__main__")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": ""},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "aggdec", done.stdout + done.stderr
