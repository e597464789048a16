"""`_manifest.json`: what a job was (spec, versions, model sha, method signature) and what it produced.

    {"format": "aggdec-job-manifest v1", "complete": true, "spec": {...}, "aggdec_version": "0.1.0",
     "ray_version": "2.60.0", "model": {"path": ..., "sha": ...}, "signature": "aggdec|method:iad|...",
     "shards": {"part-00000": {marker record}, ...},
     "totals": {"rows", "ok", "error", "status": {...}, "speedup": SpeedupStats.to_dict(),
                "backends": {backend: actors}, "compile_s": seconds,
                "distill": {"kept": n, "filtered": {reason: n}}  (distill jobs only)},
     "timings": {...}, "run": {"committed": [...], "skipped": [...], "stale_tmp_deleted": [...]}}

Totals are merged from the per-shard records (SpeedupStats is additive), so shards committed by an
earlier run count exactly once.
"""

from __future__ import annotations

from typing import Any

from aggdec.distill import merge_counts
from aggdec.stats import SpeedupStats
from aggdec.versions import package_version

FORMAT = "aggdec-job-manifest v1"


def totals(records: dict[str, dict]) -> dict[str, Any]:
    """Merge per-shard records into job totals; `backends`: how many actors decoded units with each
    backend (aggdec.decoding.compile_choice.backend; an actor that used two counts under both),
    `compile_s`: the seconds the actors spent compiling while they decoded the units
    (aggdec.decoding.compiled_step.compile_seconds), summed; `drafting`: the verifier calls that draft
    budgets chose for and those that drafted, summed, and the budgets' reasons (`Translator.drafting`)
    as the last unit committed recorded them. Records of aggdec versions before these fields add
    nothing to them."""
    stats = SpeedupStats()
    status: dict[str, int] = {}
    rows, compile_s = 0, 0.0
    actors: dict[str, set] = {}
    drafting = {"calls": 0, "drafting_calls": 0, "budget": []}
    for rec in records.values():
        rows += rec["rows"]
        compile_s += rec.get("compile_s", 0.0)
        for k in ("calls", "drafting_calls"):
            drafting[k] += rec.get("drafting", {}).get(k, 0)
        for backend in rec.get("backends", {}):
            actors.setdefault(backend, set()).add(rec.get("actor"))
        for k, v in rec["status"].items():
            status[k] = status.get(k, 0) + v
        fields = {k: rec["speedup"][k] for k in ("sentences", "iterations", "drafted", "accepted",
                                                  "output_tokens", "decode_ms")}
        stats = stats.merge(SpeedupStats(**fields))
    latest = max(records.values(), key=lambda rec: rec.get("committed_at", ""), default={})
    drafting["budget"] = latest.get("drafting", {}).get("budget", [])
    out = {"rows": rows, "ok": status.get("ok", 0), "error": status.get("error", 0), "status": status,
           "speedup": stats.to_dict(), "backends": {k: len(v) for k, v in sorted(actors.items())},
           "compile_s": round(compile_s, 3), "drafting": drafting}
    distill = [rec["distill"] for rec in records.values() if "distill" in rec]
    if distill:
        out["distill"] = merge_counts(distill)
    return out


def build_manifest(*, spec: dict, model_path: str, model_sha: str, signature: str, records: dict[str, dict],
                   complete: bool, timings: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "complete": complete,
        "spec": spec,
        "aggdec_version": package_version("aggdec"),
        "ray_version": package_version("ray"),
        "model": {"path": model_path, "sha": model_sha},
        "signature": signature,
        "shards": dict(sorted(records.items())),
        "totals": totals(records),
        "timings": timings,
        "run": run,
    }
