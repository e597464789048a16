"""Checks a job must pass before Ray starts, each failing with one line that names the culprit.

`check_job` reads every input footer (jobs.inputs), refuses an output location that is, holds or
lies inside an input, makes sure the output location can be written,
has room and is not in use by another job (jobs.lease), loads the model and the drafter the way the
decode actors will, and looks at the ids: duplicates are reported (or refused with
input.duplicate_ids = "error"), as are files in an input directory that are not Parquet or that are
skipped as hidden. Damaged data pages are not this module's: the unit that holds one fails when it
is decoded, naming the file and row group, and the other units commit.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from aggdec import checkpoint
from aggdec.decoding.options import OptionError
from jobs.inputs import Shard, check_output_apart, inspect_inputs, list_input_files
from jobs.lease import Lease, LeaseHeld, held_message, read_holder, takeover_note
from jobs.spec import JobSpec, SpecError
from jobs.storage import Location, is_uri, resolve

OUTPUT_BYTES_PER_INPUT_BYTE = 3.0
"""Free space asked for on a local output file system: this many times the inputs' size (outputs
hold the source, the hypothesis and per-row statistics)."""


def check_job(spec: JobSpec, *, warn: Callable[[str], None] = lambda msg: None,
              take_over_lease: bool = False, lease: Lease | None = None,
              shards: list[Shard] | None = None) -> list[Shard]:
    """The job's shards, after every check; raises SpecError naming the file, column or field, and
    LeaseHeld (a SpecError) naming the other job when another live job holds the output location
    (jobs.lease; `take_over_lease` as in jobs.run.run_job; `lease`: this job's, already held, and
    `shards` its inputs, already inspected and found apart from its output)."""
    if shards is None:
        shards = inspect_inputs(spec)
        check_output_apart(spec, shards)
    _check_output(spec, shards, warn, take_over_lease, lease)
    _check_models(spec)
    _check_ids(spec, shards, warn)
    _check_strays(spec, warn)
    return shards


def _check_output(spec: JobSpec, shards: list[Shard], warn: Callable[[str], None], take_over: bool,
                  lease: Lease | None) -> None:
    loc_uri = spec.output.dir
    probe = f".aggdec-write-check.{uuid.uuid4().hex}"
    try:
        loc = Location(loc_uri)
        loc.makedirs()
        # the lease first (unless this job holds it): a live holder's start-up clean-up deletes temporary
        # files, this probe's too
        holder = read_holder(loc) if lease is None else None
        if holder is not None and not (take_over or holder.stale()):
            raise LeaseHeld(held_message(loc, holder))
        loc.write_bytes(probe, b"")
        loc.delete(probe)
    except LeaseHeld:
        raise
    except (OSError, ValueError) as e:
        raise SpecError(f"output.dir: {loc_uri}: cannot be written ({_first_line(e)})") from e
    if holder is not None:
        warn(takeover_note(holder, take_over))
    if loc.local:
        need = OUTPUT_BYTES_PER_INPUT_BYTE * sum(dict(s.identity).get("size", 0) for s in shards)
        free = shutil.disk_usage(loc.root).free
        if free < need:
            free_mb, need_mb = _megabytes(free, need)
            raise SpecError(f"output.dir: {loc_uri}: {free_mb} MB free, the output needs about {need_mb} MB")


def _check_models(spec: JobSpec) -> None:
    try:
        bundle = checkpoint.load(spec.model)
    except (OSError, ValueError) as e:
        raise SpecError(f"model: {_first_line(e)}") from e
    try:  # a multilingual model's languages (aggdec.conventions)
        bundle.conventions.resolve(bundle.model.cfg.eos, spec.decode.source_lang, spec.decode.target_lang)
    except OptionError as e:
        raise SpecError(f"decode.{e}") from e
    drafter = getattr(spec.decode, "drafter", None)
    if drafter:
        try:
            checkpoint.load_drafter(drafter, bundle)
        except (OSError, ValueError) as e:
            raise SpecError(f"decode.drafter: {_first_line(e)}") from e


def _check_ids(spec: JobSpec, shards: list[Shard], warn: Callable[[str], None]) -> None:
    col, mode = spec.input.id_column, spec.input.duplicate_ids
    if not col or mode == "ignore" or not shards:
        return
    ids = []
    for s in shards:
        fs, path = resolve(s.path)
        with fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            for g in range(pf.metadata.num_row_groups):
                try:
                    ids.append(pc.cast(pf.read_row_group(g, columns=[col]).column(col), pa.string()).combine_chunks())
                except (pa.ArrowException, OSError):
                    pass  # damaged data: the unit holding this row group fails naming it, the others commit
    counts = pc.value_counts(pa.chunked_array(ids, type=pa.string()).combine_chunks())
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(dup):
        examples = ", ".join(repr(v) for v in dup.field("values")[:3].to_pylist())
        msg = (f"input.id_column: {len(dup)} id(s) occur more than once across the input files (e.g. {examples}); "
               "the output keeps every row")
        if mode == "error":
            raise SpecError(msg + '; set input.duplicate_ids = "warn" to go on')
        warn("warning: " + msg)


def _check_strays(spec: JobSpec, warn: Callable[[str], None]) -> None:
    path = spec.input.path
    hidden: list[str] = []
    list_input_files(path, hidden)
    if hidden:
        warn(f"warning: input.path: skipping {len(hidden)} hidden file(s) (names starting with '_' or '.', which "
             f"Parquet readers skip): {', '.join(hidden[:5])}{', ...' if len(hidden) > 5 else ''}; "
             "name them in input.path (a file or a glob) to decode them")
    if is_uri(path) or not Path(path).is_dir():
        return
    strays = sorted(p.name for p in Path(path).iterdir()
                    if p.is_file() and p.suffix != ".parquet" and not p.name.startswith(("_", ".")))
    if strays:
        warn(f"warning: input.path: ignoring {len(strays)} file(s) that are not *.parquet: {', '.join(strays[:5])}")


def _megabytes(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` bytes in MB, with as many decimals (1 to 6) as it takes for unequal sizes to read
    unequal."""
    for digits in range(1, 7):
        shown = f"{a / 1e6:.{digits}f}", f"{b / 1e6:.{digits}f}"
        if shown[0] != shown[1]:
            break
    return shown


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
