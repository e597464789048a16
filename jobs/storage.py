"""Where job inputs and outputs live: local or mounted paths and any pyarrow file system URI.

`Location("s3://bucket/out")`, `Location("/mnt/shared/out")`, `Location("gs://...")`: pyarrow.fs
resolves the scheme (s3, gs, abfs, hdfs; other fsspec schemes through fsspec when installed) and
reads credentials the way those libraries do (environment, config files, instance metadata; for
s3 also AWS_ENDPOINT_URL). A Location pickles as its URI, so Ray workers resolve it themselves.

Writes are write-once: on a local file system through a `.<name>.tmp` file in the same directory
renamed into place, on object stores (no rename there) by one PUT, which makes an object appear
whole or not at all.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO
from urllib.parse import unquote, urlsplit

import pyarrow.fs as pafs


def is_uri(path: str) -> bool:
    return "://" in path


GLOB_CHARS = "*?["


def is_glob(path: str) -> bool:
    return any(ch in path for ch in GLOB_CHARS)


def glob_base(pattern: str) -> str:
    """The directory a glob searches: its part before the last '/' that precedes the first wildcard."""
    cut = min(pattern.find(ch) for ch in GLOB_CHARS if ch in pattern)
    return pattern[: pattern.rfind("/", 0, cut)] if "/" in pattern[:cut] else "."


def location_key(path: str) -> str:
    """A form of a local path or URI in which the same place is spelled one way: local paths and
    file:// URIs absolute with every symbolic link resolved (the path need not exist); other URIs as
    scheme://authority/path, without a trailing '/' or repeated '/'."""
    if not is_uri(path):
        return os.path.realpath(Path(path).expanduser())
    parts = urlsplit(path)
    if parts.scheme.lower() == "file":
        return os.path.realpath(unquote(parts.path))
    inner = posixpath.normpath("/" + parts.path.lstrip("/")).rstrip("/")
    return f"{parts.scheme.lower()}://{parts.netloc}{inner}"


def within(inner: str, outer: str) -> bool:
    """Whether location key `inner` is `outer` or lies under it (see location_key)."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """(file system, path within it) of a local path or URI."""
    if not is_uri(path):
        return pafs.LocalFileSystem(), str(Path(path).expanduser().absolute())
    try:
        return pafs.FileSystem.from_uri(path)
    except ValueError as e:  # pyarrow does not know the scheme
        try:
            import fsspec
        except ImportError:
            raise ValueError(f"{path}: unsupported file system scheme ({e}); installing fsspec may add it") from e
        fs, inner = fsspec.core.url_to_fs(path)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), inner


class Location:
    """A directory (or object prefix) and the files under it, by name."""

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/") if is_uri(uri) else str(Path(uri).expanduser().absolute())
        self.fs, self.root = resolve(self.uri)
        self.local = isinstance(self.fs, pafs.LocalFileSystem)

    def __reduce__(self):
        return (Location, (self.uri,))

    def __repr__(self) -> str:
        return f"Location({self.uri!r})"

    def path(self, name: str) -> str:
        """The path of `name` within the file system."""
        return f"{self.root}/{name}"

    def uri_of(self, name: str) -> str:
        return f"{self.uri}/{name}"

    def makedirs(self) -> None:
        self.fs.create_dir(self.root, recursive=True)

    def names(self) -> list[str]:
        """Names of the files directly under this location (none if it does not exist)."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except FileNotFoundError:
            return []
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def exists(self, name: str) -> bool:
        return self.fs.get_file_info(self.path(name)).type == pafs.FileType.File

    def size(self, name: str) -> int | None:
        info = self.fs.get_file_info(self.path(name))
        return info.size if info.type == pafs.FileType.File else None

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open_input_stream(self.path(name)) as f:
            return f.read()

    def write(self, name: str, write: Callable[[IO[bytes]], None]) -> None:
        """Write `name` once, whole (see module docstring); a write that fails leaves nothing behind."""
        if not self.local:
            with self.fs.open_output_stream(self.path(name)) as f:
                write(f)
            return
        tmp = self.path(f".{name}.tmp")
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(name))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.write(name, lambda f: f.write(data))

    def delete(self, name: str) -> None:
        try:
            self.fs.delete_file(self.path(name))
        except FileNotFoundError:
            pass


@contextmanager
def removed_if_left_empty(path: str) -> Iterator[None]:
    """Remove the local directory `path` on leaving where it did not exist on entering and is empty
    then (object stores hold no empty directories): a job that fails to start leaves nothing behind."""
    new = None if is_uri(path) else Path(path).expanduser().absolute()
    if new is not None and os.path.lexists(new):
        new = None
    try:
        yield
    finally:
        if new is not None:
            try:
                os.rmdir(new)
            except OSError:  # not empty (the job wrote there) or gone
                pass


HIDDEN_PREFIXES = ("_", ".")
"""Names that Parquet readers (pyarrow, Spark, pandas) skip in a directory: `_SUCCESS`, `.crc`, ..."""


def is_hidden(name: str) -> bool:
    return name.startswith(HIDDEN_PREFIXES)


def list_files(pattern: str, hidden: list[str] | None = None) -> list[str]:
    """A file, a directory or prefix (its *.parquet files, not hidden ones: names starting with '_'
    or '.', as Parquet readers skip them), or a glob (`*`, `?`, `[`: every file it matches, hidden
    ones too), local or URI -> sorted paths or URIs as given. [] when nothing matches;
    FileNotFoundError when a file or directory does not exist. `hidden`, if given, receives the
    names of the *.parquet files a directory input skips."""
    glob = is_glob(pattern)
    base = glob_base(pattern) if glob else pattern
    fs, path = resolve(base)
    info = fs.get_file_info(path)
    if not glob and info.type == pafs.FileType.File:
        return [pattern if is_uri(pattern) else path]
    if info.type != pafs.FileType.Directory:
        if glob:
            return []
        raise FileNotFoundError(pattern)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive="**" in pattern))
    prefix = base.rstrip("/") if is_uri(base) else None

    def named(p: str) -> str:
        return f"{prefix}{p[len(path):]}" if prefix else p

    if glob:
        full = pattern if is_uri(pattern) else str(Path(pattern).expanduser().absolute())
        return sorted(named(i.path) for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(named(i.path), full))
    parquet = [i for i in infos if i.type == pafs.FileType.File and i.extension == "parquet"]
    if hidden is not None:
        hidden.extend(sorted(i.base_name for i in parquet if is_hidden(i.base_name)))
    return sorted(named(i.path) for i in parquet if not is_hidden(i.base_name))
