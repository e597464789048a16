"""Run a job on the connected Ray cluster: check inputs, skip committed units, decode, record.

    conn = cluster.connection.connect()          # the caller (cli.py) owns ray.init
    result = jobs.run.run_job(load_spec("examples/correct.toml"))
    print(result.summary_line())

Order of work: (1) read every input footer, refuse an output location that overlaps an input, and
take the output location's lease (jobs.lease: one job at a time per location), before any Ray
work; (2) plan the commit units (jobs.units), keep the units committed for this job and these
inputs as they are now, delete stale tmp files and every other file a job wrote there
(jobs.commit.OutputDir.clean); (3) run the pending units on the decode actors, which write their
outputs and commit records themselves (jobs.work); the driver only collects the records and
rewrites the manifest as they arrive; (4) if actors or nodes are lost beyond Ray's own retries, re-plan the
actors on the nodes left and run the units that did not commit, up to `resources.max_attempts`
times, saying so in one line.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from aggdec.bundle import file_sha
from aggdec.decoding.options import output_options
from cluster.connection import alive_nodes
from cluster.resources import ActorPlan, plan_actors
from jobs.commit import OutputDir, UnwritableOutput
from jobs.inputs import Shard, check_output_apart, input_locations, inspect_inputs
from jobs.lease import Lease
from jobs.manifest import build_manifest, totals
from jobs.pipeline import build_pipeline
from jobs.spec import JobSpec, SpecError
from jobs.units import Unit, plan_units, slice_contents
from jobs.work import UnitTask

MANIFEST_EVERY_S = 2.0
"""The manifest is rewritten at most this often while units commit (and at the end)."""


@dataclass(frozen=True)
class Progress:
    """Where a running job stands: rows and units of this run done / to do, failed units, rows with
    status error so far, seconds since decoding started."""

    rows: int
    rows_total: int
    units: int
    units_total: int
    failed: int
    errors: int
    seconds: float

    def line(self) -> str:
        rate = self.rows / self.seconds if self.seconds > 0 else 0.0
        eta = (self.rows_total - self.rows) / rate if rate > 0 else float("nan")
        return (f"{self.rows}/{self.rows_total} rows, {rate:.1f} rows/s, ETA {_clock(eta)}, "
                f"{self.units}/{self.units_total} units committed, {self.errors} error rows"
                + (f", {self.failed} units failed" if self.failed else ""))


def _clock(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@dataclass
class JobResult:
    output_dir: str
    manifest: str
    rows: int  # rows of all units, including those committed by earlier runs
    status: dict[str, int]  # rows per status, all units
    decoded_rows: int  # rows decoded by this run
    committed: list[str] = field(default_factory=list)  # units committed by this run
    skipped: list[str] = field(default_factory=list)  # units already committed, left alone
    pipeline_seconds: float = 0.0  # decoding and committing of this run
    wall_seconds: float = 0.0
    decoder_seconds: float = 0.0  # the decoded rows' summed decode_ms (every actor, every run), in seconds
    decoder_sentences: int = 0  # the rows decoder_seconds counts (status ok or truncated)
    drafted: int = 0  # draft tokens of all units (0 for methods without drafts)
    drafting: dict = field(default_factory=dict)  # manifest.totals' "drafting": what the draft budgets did
    mean_accepted_per_iter: float = 0.0
    tokens_per_iter: float = 0.0
    attempts: int = 0  # pipeline runs (more than 1 after lost actors or nodes)
    backends: dict[str, int] = field(default_factory=dict)  # this run's actors that decoded units with each backend
    compile_seconds: float = 0.0  # seconds this run's actors spent compiling decoder programs, summed
    distill: dict | None = None  # distill jobs: {"kept": n, "filtered": {reason: n}}, all units

    @property
    def ok(self) -> int:
        return self.status.get("ok", 0)

    @property
    def errors(self) -> int:
        return self.status.get("error", 0)

    @property
    def sentences_per_s(self) -> float:
        """Rows decoded by this run per second of wall-clock time (decoding and committing)."""
        return self.decoded_rows / self.pipeline_seconds if self.pipeline_seconds > 0 else 0.0

    def summary_line(self) -> str:
        """One line: rows by status; this run's rows and wall-clock time ("wall"); the decoder time
        of all rows (summed over actors, so it can exceed the wall time; aggdec report uses the same
        names); which backend decoded on how many actors, and the seconds they spent compiling (where
        any compiled); acceptance where the method drafted; the output."""
        other = {k: v for k, v in self.status.items() if k not in ("ok", "error")}
        per_decoder_s = self.decoder_sentences / self.decoder_seconds if self.decoder_seconds > 0 else 0.0
        return (f"{self.rows} rows ({self.ok} ok, {self.errors} error"
                + "".join(f", {v} {k}" for k, v in sorted(other.items())) + ")"
                + f"; decoded {self.decoded_rows}: wall {self.pipeline_seconds:.1f} s, {self.sentences_per_s:.1f} "
                  "sentences/s"
                + (f", skipped {len(self.skipped)} committed unit(s)" if self.skipped else "")
                + f"; decoder time {self.decoder_seconds:.2f} s ({per_decoder_s:.1f} sentences/s of decoder time)"
                + (f"; backend {self._backend_text()}" if self.backends else "")
                + (f"; kept {self.distill['kept']} pairs" + "".join(
                    f", {n} {r}" for r, n in self.distill["filtered"].items()) if self.distill else "")
                + self._drafting_text()
                + (f"; mean accepted draft tokens per verifier call {self.mean_accepted_per_iter:.2f}"
                   if self.drafted else "")
                + f"; output {self.output_dir}")

    def _drafting_text(self) -> str:
        """"; drafted on 3% of 512 verifier calls (draft_length auto: no draft; ...)" where a draft
        budget chose the calls' draft lengths."""
        calls = self.drafting.get("calls", 0)
        if not calls:
            return ""
        why = " | ".join(self.drafting.get("budget", []))
        return (f"; drafted on {self.drafting['drafting_calls'] / calls:.0%} of {calls} verifier call"
                f"{'' if calls == 1 else 's'}" + (f" (draft_length auto: {why})" if why else ""))

    def _backend_text(self) -> str:
        """"compiled on 2 actors, eager on 1, compiling 31.2 s" (the compiling where any did)."""
        text = ", ".join(f"{name} on {n} actor{'' if n == 1 else 's'}" if i == 0 else f"{name} on {n}"
                         for i, (name, n) in enumerate(sorted(self.backends.items(), key=lambda kv: -kv[1])))
        compiled = self.compile_seconds > 0 or any(name.startswith("compiled") for name in self.backends)
        return text + (f", compiling {self.compile_seconds:.1f} s" if compiled else "")


def fingerprint(spec: JobSpec, model_sha: str) -> dict:
    """What must match for a rerun to reuse committed units, by dotted spec field: the kind, the
    model's weights, every decoding option that can change an output (aggdec.decoding.methods.
    output_options, which includes the package version and the acceptance rule), the input columns
    and (distill jobs) the [distill] options. The input slice itself is checked separately."""
    fp = {"kind": spec.kind, "model.sha": model_sha,
          **{f"decode.{k}": v for k, v in output_options(spec.decode).items()},
          "input.text_column": spec.input.text_column, "input.id_column": spec.input.id_column}
    if spec.kind == "distill":
        fp.update({f"distill.{k}": v for k, v in dataclasses.asdict(spec.distill).items()})
    return fp


def run_job(spec: JobSpec, *, log: Callable[[str], None] = lambda msg: None,
            warn: Callable[[str], None] = lambda msg: None,
            progress: Callable[[Progress], None] = lambda p: None, timings: dict | None = None,
            take_over_lease: bool = False, lease: Lease | None = None) -> JobResult:
    """Run `spec` on the connected Ray cluster. Raises SpecError (bad input) before any Ray work.

    The job holds the output location's lease (jobs.lease) from before it touches the location
    until it ends: a location held by another live job raises LeaseHeld (a SpecError) naming it;
    `take_over_lease` takes over any holder's lease (for a holder known to be gone). `lease`: that lease,
    already taken by the caller (`aggdec run` takes it before Ray starts, so that a job started at the same
    moment is refused at once); the caller releases it.

    `log` gets what the job does (one line each), `warn` what the user should see even when `log`
    is not shown (the plan line: rows, units, actors and their resources, before the first pipeline
    run; one line when lost actors or nodes make the job redo units), `progress` a
    Progress after every committed or failed unit; `timings` (e.g. {"ray_init_s": ...}) is
    recorded in the manifest.
    """
    t0 = time.perf_counter()
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    shards = inspect_inputs(spec)
    check_output_apart(spec, shards)
    model_sha = file_sha(Path(spec.model) / "model.safetensors")
    out = OutputDir(spec.output.dir, inputs=input_locations(spec, shards))
    with nullcontext(lease) if lease is not None else Lease(out.loc, take_over=take_over_lease) as held:
        if held.taken_over is not None:
            log(f"took over the lease of a job that is gone ({held.taken_over.describe()})")
        return _run_units(spec, out, held, shards, model_sha, t0, started_at, log, warn, progress, timings)


def _run_units(spec: JobSpec, out: OutputDir, lease: Lease, shards: list[Shard], model_sha: str, t0: float,
               started_at: str, log: Callable[[str], None], warn: Callable[[str], None],
               progress: Callable[[Progress], None], timings: dict | None) -> JobResult:
    """run_job's work once the lease is held."""
    signature = spec.decode.signature(model_sha)
    fp = fingerprint(spec, model_sha)
    stale = out.prepare()
    units = plan_units(shards, spec.batching.rows_per_task, spec.batching.pack_rows)
    found = out.records()
    out.check_job(found, fp)
    t_hash = time.perf_counter()
    records = _committed_units(out, units, found)
    hash_s = time.perf_counter() - t_hash
    todo = [u for u in units if u.name not in records]
    removed, strangers = out.clean(found, keep=records, writes=[u.name for u in todo])
    if strangers:
        warn(f"warning: output.dir: {len(strangers)} Parquet file(s) that no aggdec job wrote "
             f"({', '.join(strangers[:3])}{', ...' if len(strangers) > 3 else ''}); readers of the directory "
             "see their rows too")
    skipped = sorted(records)
    timing = dict(timings or {}, inspect_s=round(time.perf_counter() - t0, 3), content_hash_s=round(hash_s, 3))
    run_info = {"started_at": started_at, "committed": [], "skipped": skipped, "stale_tmp_deleted": stale,
                "stale_outputs_deleted": removed, "units": len(units)}
    if skipped:
        log(f"skipping {len(skipped)} committed unit(s)")
    last_write = [0.0]
    unwritten: list[str] = []  # why the last manifest write failed, if it did

    def write_manifest(complete: bool, force: bool = True) -> None:
        now = time.perf_counter()
        if not force and now - last_write[0] < MANIFEST_EVERY_S:
            return
        last_write[0] = now
        timing["wall_s"] = round(now - t0, 3)
        try:
            out.write_manifest(build_manifest(
                spec=spec.to_dict(), model_path=spec.model, model_sha=model_sha, signature=signature,
                records=records, complete=complete, timings=timing, run=run_info))
            unwritten.clear()
        except UnwritableOutput as e:  # the units commit without it; said when the job ends
            unwritten[:] = [str(e)]

    task = UnitTask(output=out.uri, text_column=spec.input.text_column, id_column=spec.input.id_column,
                    passthrough=shards[0].passthrough if shards else (), method=spec.method, fingerprint=fp,
                    score=spec.keep_scores, nbest=spec.nbest, distill=spec.distill if spec.kind == "distill" else None,
                    tsv=spec.kind == "distill" and spec.distill.tsv)
    t_pipe = time.perf_counter()
    decoded_rows, attempts, complete, errors = 0, 0, False, 0
    failed: dict[str, str] = {}
    try:
        pending = todo
        while pending:
            attempts += 1
            plan = _plan(spec)
            plan = dataclasses.replace(plan, actors=min(plan.actors, len(pending)))  # no actor without a unit
            timing["actors"] = {"actors": plan.actors, "num_cpus": plan.num_cpus, "num_gpus": plan.num_gpus,
                                "device": plan.device, "torch_threads": plan.torch_threads}
            (warn if attempts == 1 else log)(f"decoding {sum(u.rows for u in pending)} rows in {len(pending)} "
                                             f"unit(s) with {plan.describe()}; method {spec.method}")
            try:
                # closed on any exit, so Ray Data stops its executor before Ray is shut down
                with closing(iter(build_pipeline(spec, plan, task, pending).iter_rows())) as rows:
                    for row in rows:
                        if lease.lost:
                            raise SpecError(lease.lost)
                        record = json.loads(row["record"])
                        errors += record.get("status", {}).get("error", 0)
                        if "failed" in record:
                            failed[record["unit"]] = record["failed"]
                            log(f"could not decode {record['unit']}: {record['failed']}")
                        else:
                            records[record["unit"]] = record
                            run_info["committed"].append(record["unit"])
                            decoded_rows += record["rows"]
                            write_manifest(complete=False, force=False)
                            log(f"committed {record['unit']} ({record['rows']} rows)")
                        progress(Progress(rows=decoded_rows, rows_total=sum(u.rows for u in todo),
                                          units=len(run_info["committed"]), units_total=len(todo), failed=len(failed),
                                          errors=errors, seconds=time.perf_counter() - t_pipe))
            except Exception as e:  # lost actors or nodes beyond Ray's retries: run what did not commit
                if _is_task_error(e):  # the task itself raised: running it again would raise again
                    raise RuntimeError(f"a decode actor failed: {_root_cause(e)}") from None
                if attempts >= spec.resources.max_attempts or not _is_ray_failure(e):
                    raise
                lost = f"{_what_was_lost(e)} ({type(e).__name__})"  # not `e`: its frames hold the old actors
            else:
                lost = None
            found = out.records()
            pending = []
            for unit in todo:
                if unit.name in records or unit.name in failed:
                    continue
                record = found.get(unit.name)
                if _same_plan(record, unit) and out.committed(unit.name, record, record["input"]):  # record lost
                    records[unit.name] = found[unit.name]
                    run_info["committed"].append(unit.name)
                    decoded_rows += unit.rows
                else:
                    pending.append(unit)
            if lost is not None:
                warn(f"{lost}; redoing the {len(pending)} unit(s) that did not commit on the nodes left "
                     f"(run {attempts + 1} of at most {spec.resources.max_attempts})")
        complete = not failed
    finally:
        timing["pipeline_s"] = round(time.perf_counter() - t_pipe, 3)
        run_info["attempts"] = attempts
        run_info["failed"] = failed
        if not lease.lost:  # else the location is another job's now
            write_manifest(complete=complete)
    if lease.lost:
        raise SpecError(lease.lost)
    if failed:
        first = next(iter(failed.values()))
        raise SpecError(f"{first}" + (f" (and {len(failed) - 1} more unit(s))" if len(failed) > 1 else "")
                        + f"; the other {len(records)} unit(s) committed, a rerun retries the failed ones")
    if unwritten:
        raise SpecError(f"{unwritten[0]}; every unit committed, a rerun writes it")
    tot = totals(records)
    speed = tot["speedup"]
    ran = totals({unit: records[unit] for unit in run_info["committed"]})  # this run's actors, not a resumed one's
    return JobResult(output_dir=out.uri, manifest=out.loc.uri_of("_manifest.json"), rows=tot["rows"],
                     status=tot["status"], decoded_rows=decoded_rows, committed=list(run_info["committed"]),
                     skipped=skipped, pipeline_seconds=timing["pipeline_s"], wall_seconds=timing["wall_s"],
                     decoder_seconds=speed["decode_ms"] / 1000.0, decoder_sentences=speed["sentences"],
                     drafted=speed["drafted"], drafting=tot["drafting"],
                     mean_accepted_per_iter=speed["mean_accepted_per_iter"], tokens_per_iter=speed["tokens_per_iter"],
                     attempts=attempts, distill=tot.get("distill"), backends=ran["backends"],
                     compile_seconds=ran["compile_s"])


def _committed_units(out: OutputDir, units: list[Unit], found: dict[str, dict | None]) -> dict[str, dict]:
    """{unit: record} of the units committed for their input as it is now: a record for the same
    file size, footer and rows whose slice hashes the same now (jobs.units.slice_contents)."""
    candidates = [u for u in units if _same_plan(found.get(u.name), u)]
    return {u.name: found[u.name] for u, content in zip(candidates, slice_contents(candidates))
            if content is not None and out.committed(u.name, found[u.name], {**u.identity, "content": content})}


def _same_plan(record: dict | None, unit: Unit) -> bool:
    """Whether `record` was committed for `unit`'s file size, footer and rows (its content aside)."""
    planned = (record or {}).get("input")
    return isinstance(planned, dict) and {k: v for k, v in planned.items() if k != "content"} == unit.identity


def _what_was_lost(e: Exception) -> str:
    """'lost a node' / 'lost a decode actor' / 'the pipeline failed', from a Ray failure."""
    import ray.exceptions

    text = str(e)
    if isinstance(e, ray.exceptions.NodeDiedError) or "node has died" in text or "node was terminated" in text:
        return "lost a node"
    if isinstance(e, (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)) or "actor" in text.lower():
        return "lost a decode actor"
    return "the pipeline failed"


def _is_task_error(e: Exception) -> bool:
    """Whether `e` is an exception the decode task raised (not a lost actor or node)."""
    import ray.exceptions

    return isinstance(e, ray.exceptions.UserCodeException)


def _root_cause(e: BaseException) -> str:
    """'<type>: <message>' of the exception a Ray task raised: the first exception line of the remote
    traceback that Ray keeps as text (its own wrappers, `ray.*`, left out)."""
    for line in str(e).splitlines():
        if re.match(r"[A-Za-z_][\w.]*: ", line) and not line.startswith("ray."):
            return line.strip()
    return type(e).__name__


def _is_ray_failure(e: Exception) -> bool:
    import ray.exceptions

    return isinstance(e, (ray.exceptions.RayError, ray.exceptions.RayTaskError)) or "Actor" in type(e).__name__


def _plan(spec: JobSpec) -> ActorPlan:
    r = spec.resources
    try:
        return plan_actors(alive_nodes(), actors=r.actors, gpus_per_actor=r.gpus_per_actor,
                           cpus_per_actor=r.cpus_per_actor, torch_threads=r.torch_threads,
                           max_restarts=r.max_restarts, max_task_retries=r.max_task_retries)
    except ValueError as e:
        raise SpecError(str(e)) from e
