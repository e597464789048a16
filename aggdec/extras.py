"""Optional extras (pyproject.toml's optional-dependencies): the command that installs one."""

from __future__ import annotations

from pathlib import Path

SOURCE_TREE = Path(__file__).resolve().parent.parent


def install_hint(extra: str) -> str:
    """The pip command that installs `extra` for this copy of aggdec: run from a source tree (a
    clone, installed editable or not) `pip install --no-build-isolation -e 'DIR[extra]'`, DIR being
    "." when the tree is the current directory (without build isolation: the tree's CPU kernel builds
    against the installed torch, setup.py); from an installed package `pip install 'aggdec[extra]'`."""
    if (SOURCE_TREE / "pyproject.toml").is_file():
        where = "." if SOURCE_TREE == Path.cwd().resolve() else str(SOURCE_TREE)
        return f"pip install --no-build-isolation -e '{where}[{extra}]'"
    return f"pip install 'aggdec[{extra}]'"
