"""Run a job on the connected Ray cluster: check inputs, skip committed shards, decode, commit.

    conn = cluster.connection.connect()          # the caller (cli.py) owns ray.init
    result = jobs.run.run_job(load_spec("examples/correct.toml"))
    print(result.summary_line())

Order of work: (1) check every input schema and the output directory, before any Ray work;
(2) delete stale tmp files, keep committed shards, delete partial ones; (3) stream the remaining
shards through Read -> Decode; the driver commits each shard as soon as all its rows arrived;
(4) write the manifest (also after every commit, so a killed driver leaves an up-to-date one).
Distill jobs also filter each shard's pairs and commit its training TSV (aggdec.distill).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from aggdec.checkpoint import file_sha
from aggdec.decoding.methods import output_options
from aggdec.distill import distill_table
from aggdec.schema import decoded_schema
from cluster.connection import cluster_resources
from cluster.resources import ActorPlan, plan_actors
from jobs.assemble import ShardAssembler
from jobs.commit import OutputDir, write_json
from jobs.inputs import Shard, inspect_inputs
from jobs.manifest import build_manifest, totals
from jobs.output import build_output_table, shard_stats
from jobs.pipeline import build_pipeline, read_shards
from jobs.spec import JobSpec, SpecError


@dataclass
class JobResult:
    output_dir: str
    manifest: str
    rows: int  # rows of all shards, including those committed by earlier runs
    status: dict[str, int]  # rows per status, all shards
    decoded_rows: int  # rows decoded by this run
    committed: list[str] = field(default_factory=list)  # shards committed by this run
    skipped: list[str] = field(default_factory=list)  # shards already committed, left alone
    pipeline_seconds: float = 0.0  # Read -> Decode -> commit of this run
    wall_seconds: float = 0.0
    mean_accepted_per_iter: float = 0.0
    tokens_per_iter: float = 0.0
    duplicates_dropped: int = 0
    distill: dict | None = None  # distill jobs: {"kept": n, "filtered": {reason: n}}, all shards

    @property
    def ok(self) -> int:
        return self.status.get("ok", 0)

    @property
    def errors(self) -> int:
        return self.status.get("error", 0)

    @property
    def sentences_per_s(self) -> float:
        return self.decoded_rows / self.pipeline_seconds if self.pipeline_seconds > 0 else 0.0

    def summary_line(self) -> str:
        other = {k: v for k, v in self.status.items() if k not in ("ok", "error")}
        return (f"{self.rows} rows ({self.ok} ok, {self.errors} error"
                + "".join(f", {v} {k}" for k, v in sorted(other.items())) + ")"
                + f"; decoded {self.decoded_rows} in {self.pipeline_seconds:.1f}s ({self.sentences_per_s:.1f} sentences/s)"
                + (f", skipped {len(self.skipped)} committed shard(s)" if self.skipped else "")
                + (f"; kept {self.distill['kept']} pairs" + "".join(
                    f", {n} {r}" for r, n in self.distill["filtered"].items()) if self.distill else "")
                + f"; mean accepted tokens/iter {self.mean_accepted_per_iter:.2f}"
                + f"; output {self.output_dir}")


def fingerprint(spec: JobSpec, model_sha: str) -> dict:
    """What must match for a rerun to reuse committed shards, by dotted spec field: the kind, the
    model's weights, every decoding option that can change an output (aggdec.decoding.methods.
    output_options, which includes the package version and the acceptance rule), the input columns
    and (distill jobs) the [distill] options."""
    fp = {"kind": spec.kind, "model.sha": model_sha,
          **{f"decode.{k}": v for k, v in output_options(spec.decode).items()},
          "input.text_column": spec.input.text_column, "input.id_column": spec.input.id_column}
    if spec.kind == "distill":
        fp.update({f"distill.{k}": v for k, v in dataclasses.asdict(spec.distill).items()})
    return fp


def run_job(spec: JobSpec, *, log: Callable[[str], None] = lambda msg: None,
            timings: dict | None = None) -> JobResult:
    """Run `spec` on the connected Ray cluster. Raises SpecError (bad input) before any Ray work.

    `timings` (e.g. {"ray_init_s": ...}) is recorded in the manifest.
    """
    t0 = time.perf_counter()
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    shards = inspect_inputs(spec)
    model_sha = file_sha(Path(spec.model) / "model.safetensors")
    signature = spec.decode.signature(model_sha)
    fp = fingerprint(spec, model_sha)
    out = OutputDir(spec.output.dir)
    stale = out.prepare()
    records: dict[str, dict] = {}
    todo: list[Shard] = []
    for shard in shards:
        rec = out.committed(shard.stem, fp)
        if rec is None:
            todo.append(shard)
        else:
            records[shard.stem] = rec
    skipped = sorted(records)
    timing = dict(timings or {}, inspect_s=round(time.perf_counter() - t0, 3))
    run_info = {"started_at": started_at, "committed": [], "skipped": skipped, "stale_tmp_deleted": stale}
    if skipped:
        log(f"skipping {len(skipped)} committed shard(s): {', '.join(skipped)}")

    def commit(shard: Shard, decoded, t_start: float) -> None:
        table = build_output_table(shard, decoded, text_column=spec.input.text_column,
                                   id_column=spec.input.id_column, method=spec.method)
        status, stats = shard_stats(decoded)
        record = {
            "input": shard.path, "output": str(out.output_path(shard.stem)), "rows": shard.rows,
            "status": status, "speedup": stats.to_dict(), "fingerprint": fp,
        }
        tsv = None
        if spec.kind == "distill":
            table, tsv, record["distill"] = distill_table(table, spec.distill, tsv=spec.distill.tsv)
            record["tsv"] = str(out.tsv_path(shard.stem)) if tsv is not None else None
        record["seconds_since_start"] = round(time.perf_counter() - t_start, 3)
        record["committed_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        records[shard.stem] = record
        out.commit(shard.stem, table, record, tsv)
        run_info["committed"].append(shard.stem)
        write_manifest(complete=False)
        log(f"committed {shard.stem} ({shard.rows} rows)")

    def write_manifest(complete: bool) -> None:
        timing["wall_s"] = round(time.perf_counter() - t0, 3)
        write_json(out.manifest_path, build_manifest(
            spec=spec.to_dict(), model_path=spec.model, model_sha=model_sha, signature=signature, records=records,
            complete=complete, timings=timing, run=run_info))

    work = [s for s in todo if s.rows > 0]
    plan = _plan(spec) if work else None
    t_pipe = time.perf_counter()
    decoded_rows, duplicates = 0, 0
    complete = False
    try:
        for shard in [s for s in todo if s.rows == 0]:
            commit(shard, decoded_schema(score=spec.keep_scores, nbest=spec.nbest).empty_table(), t_pipe)
        if plan is not None:
            timing["actors"] = {"actors": plan.actors, "num_cpus": plan.num_cpus, "num_gpus": plan.num_gpus,
                                "device": plan.device, "torch_threads": plan.torch_threads}
            log(f"decoding {sum(s.rows for s in work)} rows in {len(work)} shard(s) with {plan.actors} actor(s) "
                f"on {plan.device} ({spec.method})")
            assembler = ShardAssembler(work)
            ds = build_pipeline(spec, plan)(read_shards([s.path for s in work], spec.input.text_column,
                                                                spec.batching.rows_per_task))
            for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                for shard, decoded in assembler.add(batch):
                    commit(shard, decoded, t_pipe)
                    decoded_rows += shard.rows
            duplicates = assembler.duplicates
            missing = assembler.missing()
            if missing:
                raise RuntimeError(f"pipeline ended with rows missing: {missing}")
        complete = True
    finally:
        timing["pipeline_s"] = round(time.perf_counter() - t_pipe, 3)
        run_info["duplicates_dropped"] = duplicates
        write_manifest(complete=complete)
    tot = totals(records)
    speed = tot["speedup"]
    return JobResult(output_dir=str(out.root), manifest=str(out.manifest_path), rows=tot["rows"], status=tot["status"],
                     decoded_rows=decoded_rows, committed=list(run_info["committed"]), skipped=skipped,
                     pipeline_seconds=timing["pipeline_s"], wall_seconds=timing["wall_s"],
                     mean_accepted_per_iter=speed["mean_accepted_per_iter"], tokens_per_iter=speed["tokens_per_iter"],
                     duplicates_dropped=duplicates, distill=tot.get("distill"))


def _plan(spec: JobSpec) -> ActorPlan:
    r = spec.resources
    try:
        return plan_actors(cluster_resources(), actors=r.actors, gpus_per_actor=r.gpus_per_actor,
                           cpus_per_actor=r.cpus_per_actor, torch_threads=r.torch_threads,
                           max_restarts=r.max_restarts, max_task_retries=r.max_task_retries)
    except ValueError as e:
        raise SpecError(str(e)) from e

