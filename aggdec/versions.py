"""Installed package versions, recorded in output signatures, job manifests and metric signatures."""

from __future__ import annotations

import importlib.metadata


def package_version(name: str) -> str:
    """The installed version of distribution `name`, or "unknown"."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
