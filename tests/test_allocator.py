"""aggdec.allocator: glibc's thresholds are set once per process by a Translator."""

import platform
import subprocess
import sys

import pytest

from aggdec.allocator import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_keep_freed_memory_takes_effect_on_glibc():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # once; later calls report it


def test_a_translator_sets_it(tiny_model_dir):
    """In a fresh process: constructing a Translator sets the thresholds (where glibc runs)."""
    code = ("import aggdec.allocator as a; from aggdec.api import Translator; assert a._done is None; "
            f"Translator.load({str(tiny_model_dir)!r}); print(a._done)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(platform.libc_ver()[0] == "glibc")
