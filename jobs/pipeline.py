"""The Ray Data pipeline of a job: Read -> Decode. The driver commits the output (jobs.commit).

Read:   ray.data.read_parquet(files, include_paths=True, include_row_hash=True) keeps only the text
        column plus `path` (source file) and `row_hash` (a deterministic function of file and row
        position, which the driver inverts to a row number). Passthrough columns are not shipped:
        the driver copies them from the input file when it commits a shard.
Decode: map_batches(DecodeWorker) on a fixed actor pool (cluster.resources.ActorPlan); output
        columns as cluster.actors.output_schema (score when spec.keep_scores, nbest when
        spec.nbest), one row per input row.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable

import ray.data
from ray.data import DataContext, Dataset

from cluster.actors import DecodeWorker
from cluster.resources import ActorPlan
from jobs.spec import JobSpec


def read_shards(paths: list[str], text_column: str, rows_per_block: int) -> Dataset:
    """Rows of the given Parquet files (columns `text_column`, `path`, `row_hash`), one read task per
    file, re-cut (streaming, no shuffle) into blocks of at most `rows_per_block` rows.

    Without the re-cut a file is one block, and one block feeds one actor task: a single large file
    would keep a single actor busy while the others idle.
    """
    ctx = DataContext.get_current()
    v2 = ctx.use_datasource_v2
    if v2 and importlib.util.find_spec("aiohttp") is None:
        # Ray 2.60's V2 reader lists paths in threads, each importing fsspec's HTTP filesystem;
        # without aiohttp that import fails, and concurrent failing imports intermittently raise
        # ImportError("cannot import name 'HTTPFileSystem'"), which Ray does not catch (seen in
        # 2 of 15 reads of 3 files). The V1 reader resolves paths once, on the driver.
        ctx.use_datasource_v2 = False
    try:
        ds = ray.data.read_parquet(paths, include_paths=True, include_row_hash=True, file_extensions=None,
                                   override_num_blocks=len(paths))
    finally:
        ctx.use_datasource_v2 = v2
    ds = ds.select_columns([text_column, "path", "row_hash"])
    return ds.repartition(target_num_rows_per_block=rows_per_block)


def build_pipeline(spec: JobSpec, plan: ActorPlan) -> Callable[[Dataset], Dataset]:
    """-> a function that appends the decode stage to a dataset from `read_shards`."""

    def decode(ds: Dataset) -> Dataset:
        with warnings.catch_warnings():
            # max_restarts/max_task_retries have no named map_batches parameter in Ray 2.60; passing
            # them as extra remote args is the supported way there (deprecated from 2.64 on).
            warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
            return ds.map_batches(
                DecodeWorker,
                fn_constructor_kwargs=dict(model_dir=spec.model, options=spec.decode,
                                           text_column=spec.input.text_column, device=plan.device,
                                           torch_threads=plan.torch_threads, score=spec.keep_scores),
                batch_size=spec.batching.rows_per_task,
                batch_format="numpy",
                udf_modifying_row_count=False,
                **plan.map_batches_kwargs(),
            )

    return decode
