"""Builds aggdec's CPU kernels, decode attention (`aggdec/model/decode_attention.cpp`) and the int8
product (`aggdec/model/int8_product.cpp`), when the package is installed, so that no user's process
ever compiles them: one shared library per ATen CPU capability (`decode_attention.FLAGS`: AVX-512 and
AVX2 on x86, and everywhere the portable one), each named as `decode_attention.library` says and
compiled with `-DAGGDEC_OP=<decode_attention.OP>` and `-DAGGDEC_INT8_OP=<int8_product.OP>`, in
parallel. The libraries link against the torch installed first, hence
`pip install --no-build-isolation [-e] .` (the Makefile's setup). A failed build (no C++ compiler)
leaves the package installed without them: `decode_attention.load` then warns once and attention
runs as masked products, int8 products as compiled kernels. Everything else is in pyproject.toml.
"""

import copy
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent


def _module(name: str):
    """aggdec/model/<name>.py alone: its names, not the package's imports. Its own imports of aggdec
    resolve to this checkout (nothing may be installed yet); they may need torch alone."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location(name, ROOT / "aggdec" / "model" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kernel, int8 = _module("decode_attention"), _module("int8_product")

X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
CAPABILITIES = [*kernel.FLAGS, "DEFAULT"] if X86 else ["DEFAULT"]  # "DEFAULT": ATen's portable vectors


class BuildKernels(BuildExtension.with_options(use_ninja=False, no_python_abi_suffix=True)):
    """torch's BuildExtension (its include paths, libraries and ABI flags), where the libraries,
    which compile one source with different flags, each compile into a directory of their own
    (setuptools' parallel build runs them in threads), and where no C++ compiler runs at all
    (torch asks it its version first) nothing is built, as when one fails (`optional`)."""

    def build_extensions(self) -> None:
        try:
            super().build_extensions()
        except (OSError, subprocess.CalledProcessError) as e:  # no compiler: torch's check of its ABI
            print(f"aggdec: the CPU kernels are not built: no C++ compiler runs ({e})", file=sys.stderr)

    def build_extension(self, ext) -> None:
        job = copy.copy(self)
        job.build_temp = os.path.join(self.build_temp, ext.name)
        super(BuildKernels, job).build_extension(ext)


def extension(capability: str) -> CppExtension:
    path = kernel.library(capability).relative_to(ROOT)
    return CppExtension(".".join(path.with_suffix("").parts),
                        [str(source.relative_to(ROOT)) for source in (kernel.SOURCE, int8.SOURCE)],
                        extra_compile_args=[*kernel.CFLAGS, f"-DAGGDEC_OP={kernel.OP}", f"-DAGGDEC_INT8_OP={int8.OP}",
                                            *kernel.FLAGS.get(capability, [])],
                        extra_link_args=["-fopenmp"], optional=True)


setup(ext_modules=[extension(c) for c in CAPABILITIES], cmdclass={"build_ext": BuildKernels},
      options={"build_ext": {"parallel": min(len(CAPABILITIES), os.cpu_count() or 1)}})
