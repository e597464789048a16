"""aggdec as a Ray Data stage: decode a text column of any Dataset inside the user's own pipeline.

    import ray.data
    from jobs import build_processor

    processor = build_processor("models/gec-base", {"method": "iad"}, text_column="src", id_column="id")
    processor(ray.data.read_parquet("examples/data/gec-sample")).write_parquet("out/stage")

The shape is ray.data.llm's `build_llm_processor(config, preprocess=, postprocess=)`: a `Processor`
is a callable Dataset -> Dataset that lazily chains `dataset.map(preprocess)` (when given), a
streaming `repartition` into blocks of at most `batch_size` rows (no shuffle, order kept),
`map_batches` on a fixed pool of decode actors, and `dataset.map(postprocess)` (when given). The
decode actors are the corpus jobs' (cluster.actors.DecodeWorker, which loads the model once); their
task here (`RowsTask`) decodes the rows of each batch with `Translator.translate_batch`.

Output rows are a job's output rows (aggdec.schema), one per input row: `id` (the id column as a
string; null without one), `src` (the text column, as a string), `hyp`, every other input column
unchanged, `status`, `error`, `method` and the per-sentence statistics. A row that cannot be decoded
is a status row, never a failed Dataset: no text (None) is "empty", a value that is not a string
(or bytes) is "error" naming its type, bytes that are not UTF-8 are "invalid_utf8", and a row whose
decoding raises is "error" with the reason (Translator.translate_batch isolates it). A text column
that is missing, or another column named like an output column, fails the Dataset in one line.

What the stage does not give, which `aggdec run` (TOML jobs over Parquet) does: exactly-once output
(rows are committed by whatever sink the user writes to: a driver that dies leaves that sink's
partial output, and nothing resumes), reruns that skip committed units, a manifest with the
signature, totals and timings, the output lease, re-planning on the nodes left after lost ones (a
lost actor is restarted and its batch retried, MAX_RESTARTS times), and distill jobs. Ids are null
without `id_column` (a Dataset has no stable row numbers), and row order is Ray Data's
(`DataContext.execution_options.preserve_order`).

`jobs` loads this module (and with it Ray) on first use of `build_processor`; nothing here starts
Ray: a Dataset does, or the caller's `ray.init`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from ray.data import Dataset

from aggdec import checkpoint
from aggdec.api import Translator
from aggdec.decoding.method_options import decode_options, options_from_mapping
from aggdec.decoding.options import DecodeOptions
from aggdec.schema import RESULT_COLUMNS, decoded_columns, decoded_schema
from cluster.actors import map_decode
from cluster.connection import alive_nodes
from cluster.resources import ActorPlan, plan_actors
from jobs.output import build_output_table
from jobs.work import texts_of

CPU_SHARE = 0.5
"""CPUs a decode actor reserves on a cluster without GPUs (by default). Each actor decodes on one
thread, so one actor per core keeps the cores busy, while the other half of the logical CPUs stays
free for the Dataset's other operators (read and write tasks ask for 1 CPU each, and would wait
forever behind a pool that reserved every CPU)."""
MAX_RESTARTS = 3
"""Times a lost decode actor is restarted, and a batch retried, before the Dataset fails (Ray Data's
own default is unbounded, which loops forever on a row that kills the process every time)."""
INVALID_UTF8 = "the text is not valid UTF-8; invalid bytes were decoded as U+FFFD"
"""The `error` of an invalid_utf8 row (as a job's)."""
OUTPUT_COLUMNS = frozenset({"id", "src", "hyp", *RESULT_COLUMNS, "nbest"})
"""Output column names that no other input column may have."""


@dataclass
class RowsTask:
    """What a decode actor does with one batch of the stage: decode its text column. Picklable.

    `__call__(translator, options, batch: pyarrow.Table) -> pyarrow.Table`: the batch's output rows
    (see the module docstring), in the batch's order."""

    text_column: str
    id_column: str | None
    nbest: bool = False

    def __call__(self, translator: Translator, options: DecodeOptions, batch: pa.Table) -> pa.Table:
        passthrough = self.passthrough(batch.column_names)
        src, texts, problems = source_texts(batch.column(self.text_column), self.text_column)
        results = translator.translate_batch(texts, options)
        for i, (status, error) in problems.items():
            results[i].status, results[i].error = status, error
        decoded = pa.table(decoded_columns(results, nbest=self.nbest), schema=decoded_schema(nbest=self.nbest))
        rows = batch.set_column(batch.schema.get_field_index(self.text_column), self.text_column, src)
        table = build_output_table(rows, decoded, text_column=self.text_column, id_column=self.id_column,
                                   passthrough=passthrough, method=options.method, stem="", start=0)
        if self.id_column is None:
            table = table.set_column(0, "id", pa.nulls(table.num_rows, pa.string()))
        return table

    def passthrough(self, columns: list[str]) -> tuple[str, ...]:
        """The columns copied unchanged; raises ValueError naming the text or id column when it is
        missing, or a column whose name an output column has."""
        missing = [c for c in (self.text_column, self.id_column) if c and c not in columns]
        if missing:
            field = "text_column" if missing[0] == self.text_column else "id_column"
            raise ValueError(f"{field}: no column {missing[0]!r} in the Dataset (columns: {', '.join(columns)})")
        passthrough = tuple(c for c in columns if c not in (self.text_column, self.id_column))
        clash = [c for c in passthrough if c in OUTPUT_COLUMNS]
        if clash:
            raise ValueError(f"column {clash[0]!r} clashes with an output column of the same name; rename it"
                             + (" or pass id_column='id'" if clash[0] == "id" else ""))
        return passthrough


def source_texts(column: pa.ChunkedArray, name: str) -> tuple[pa.ChunkedArray, list[str], dict[int, tuple[str, str]]]:
    """A text column -> (itself as strings, the texts to decode, {row: (status, error)} for the rows
    that are not text). None decodes as "" (status empty); bytes are decoded as UTF-8, invalid bytes
    as U+FFFD (status invalid_utf8); any other value decodes as "" with status error."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        texts, bad = texts_of(column)
        return column, texts, {i: ("invalid_utf8", INVALID_UTF8) for i in bad}
    src: list[str | None] = []
    texts, problems = [], {}
    for i, value in enumerate(column.to_pylist()):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                value = value.decode("utf-8", errors="replace")
                problems[i] = ("invalid_utf8", INVALID_UTF8)
        elif value is not None and not isinstance(value, str):
            problems[i] = ("error", f"{name}: not a string ({type(value).__name__})")
            value = None
        src.append(value)
        texts.append(value or "")
    return pa.chunked_array([pa.array(src, type=pa.string())]), texts, problems


@dataclass(frozen=True)
class Processor:
    """A callable Dataset -> Dataset that decodes `task.text_column` on a pool of decode actors;
    built by `build_processor`. Calling it plans the actors against the cluster's alive nodes (Ray
    must be initialized, as it is once a Dataset exists) and returns the lazy Dataset."""

    model: str
    options: DecodeOptions
    task: RowsTask
    batch_size: int
    actors: int = 0
    gpus_per_actor: float | None = None
    cpus_per_actor: float | None = None
    preprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    postprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def __call__(self, dataset: Dataset) -> Dataset:
        """The lazy Dataset of output rows. Where the columns are known without running anything
        (no preprocess, a schema Ray Data already has), a missing or clashing column raises ValueError
        here; otherwise the first batch fails the Dataset with it."""
        plan = self.plan()
        if self.preprocess is not None:
            dataset = dataset.map(self.preprocess)
        else:
            schema = dataset.schema(fetch_if_missing=False)
            if schema is not None:
                self.task.passthrough(list(schema.names))
        # blocks of at most batch_size rows, so that every actor gets work: a reader may hand over
        # one block for many files (Ray 2.60's read_parquet does), which would go to a single actor
        dataset = dataset.repartition(target_num_rows_per_block=self.batch_size)
        dataset = map_decode(dataset, self.model, self.options, self.task, plan, batch_size=self.batch_size,
                             batch_format="pyarrow")
        if self.postprocess is not None:
            dataset = dataset.map(self.postprocess)
        return dataset

    def plan(self, nodes: list[dict[str, float]] | None = None) -> ActorPlan:
        """The decode actor pool on `nodes` (their resources, {"CPU": n, "GPU": m}; default: the
        connected cluster's alive nodes): `actors` actors (0: one per GPU, or one
        per CPU), each with `gpus_per_actor` GPUs (None: 1 where the cluster has GPUs, else 0; the
        model then runs on cuda) and `cpus_per_actor` CPUs (None: 1 with GPUs, else CPU_SHARE).
        Raises ValueError naming the parameter when the cluster cannot hold the pool and leave a CPU
        for the Dataset's other tasks."""
        nodes = alive_nodes() if nodes is None else nodes
        cpus = sum(n.get("CPU", 0.0) for n in nodes)
        gpus = self.gpus_per_actor
        if gpus is None:
            gpus = 1.0 if any(n.get("GPU", 0.0) > 0 for n in nodes) else 0.0
        share = self.cpus_per_actor if self.cpus_per_actor is not None else (1.0 if gpus > 0 else CPU_SHARE)
        actors = self.actors or (0 if gpus > 0 else int(cpus))
        try:
            plan = plan_actors(nodes, actors=actors, gpus_per_actor=gpus, cpus_per_actor=share,
                               max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS)
        except ValueError as e:  # the message names the job's resources.<field>: the same names here
            raise ValueError(str(e).replace("resources.", "")) from None
        if cpus - plan.actors * plan.num_cpus < 1:
            raise ValueError(f"cpus_per_actor: {plan.actors} actors of {plan.num_cpus:g} CPUs leave "
                             f"{max(cpus - plan.actors * plan.num_cpus, 0):g} of the cluster's {cpus:g} CPUs to "
                             "the Dataset's read and write tasks, which need 1; pass fewer actors or cpus_per_actor")
        return plan


def build_processor(model: str | Path, options: DecodeOptions | Mapping[str, Any] | None = None, *,
                    text_column: str, id_column: str | None = None, actors: int = 0,
                    gpus_per_actor: float | None = None, cpus_per_actor: float | None = None,
                    batch_size: int = 4096,
                    preprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                    postprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Processor:
    """A Processor that decodes `text_column` of a Dataset with the model directory `model`.

    options: DecodeOptions, or a mapping as a job spec's [decode] table ({"method": "iad",
        "max_batch_size": 64, ...}; names of other methods' options warn); None: greedy's defaults.
    text_column / id_column: the columns of the rows that reach the stage (after `preprocess`).
    actors: decode actors (ray.data.llm's `concurrency`); 0: one per GPU, or one per CPU.
    gpus_per_actor / cpus_per_actor: each actor's reservation (see Processor.plan).
    batch_size: rows per actor call, decoded with continuous batching inside the call (as a job's
        `batching.rows_per_task`); smaller batches spread a small Dataset over more actors.
    preprocess / postprocess: row -> row functions applied before / after decoding (`Dataset.map`).

    Loads the model (on CPU) and its drafter once here, as `aggdec run` does before Ray work, so that
    a model that cannot load raises ValueError in one line naming the file; options raise OptionError
    (a ValueError) naming the option. Starts nothing.
    """
    if isinstance(options, Mapping):
        options, unused = options_from_mapping(options, "greedy")
        if unused:
            warnings.warn(f"options: ignoring {', '.join(unused)} (not options of method {options.method})",
                          stacklevel=2)
    if options is None:
        options = decode_options()
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    path = Path(model).expanduser()
    check_model(str(path), options)
    return Processor(model=str(path.resolve()), options=options,
                     task=RowsTask(text_column=text_column, id_column=id_column,
                                   nbest=getattr(options, "nbest", 1) > 1),
                     batch_size=batch_size, actors=actors, gpus_per_actor=gpus_per_actor,
                     cpus_per_actor=cpus_per_actor, preprocess=preprocess, postprocess=postprocess)


def check_model(model: str, options: DecodeOptions) -> None:
    """Load `model`, resolve the languages of `options` and load its drafter, as the decode actors
    will; raise ValueError (OptionError for a language) in one line naming the culprit."""
    try:
        bundle = checkpoint.load(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"model: {_first_line(e)}") from None
    bundle.conventions.resolve(bundle.model.cfg.eos, options.source_lang, options.target_lang)
    drafter = getattr(options, "drafter", None)
    if drafter:
        try:
            checkpoint.load_drafter(drafter, bundle)
        except (OSError, ValueError) as e:
            raise ValueError(f"options.drafter: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
