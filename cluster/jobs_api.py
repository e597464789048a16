"""Ray Jobs API: submit a corpus job to a running cluster, query it, read its logs, stop it.

The job's runtime_env uploads the repository (working_dir = repo root, minus outputs and VCS
files), so the cluster runs this checkout's code; the cluster image must provide the dependencies
(torch, sentencepiece, safetensors, click, pyarrow, ray[data]) or `pip` must list them.
Entry point: `python -m cli run SPEC ...` (the same as `aggdec run`, without needing the package
installed on the cluster). Inside the job RAY_ADDRESS is set, so `run` joins the cluster.
"""

from __future__ import annotations

import shlex
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
EXCLUDES = [".git", "out", "runs", "bench/results", "**/__pycache__", "*.egg-info", ".pytest_cache", ".whl"]


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def runtime_env(pip: list[str] | None = None, working_dir: Path = REPO_ROOT) -> dict:
    env: dict = {"working_dir": str(working_dir), "excludes": list(EXCLUDES)}
    if pip:
        env["pip"] = list(pip)
    return env


def entrypoint(spec: str, run_args: list[str] | tuple[str, ...] = ()) -> str:
    """The shell command the cluster runs: `python -m cli run SPEC ARGS...` (quoted)."""
    return " ".join(shlex.quote(a) for a in ["python", "-m", "cli", "run", spec, *run_args])


def submit(address: str, spec: str, run_args: list[str] | tuple[str, ...] = (), *, pip: list[str] | None = None,
           submission_id: str | None = None, working_dir: Path = REPO_ROOT) -> str:
    """Submit `aggdec run SPEC` to the Ray dashboard at `address` (http://HEAD:8265). -> job id.

    `spec` is a path relative to the repository root (the job's working directory) or absolute on
    the cluster.
    """
    return _client(address).submit_job(entrypoint=entrypoint(spec, run_args), submission_id=submission_id,
                                       runtime_env=runtime_env(pip, working_dir),
                                       metadata={"tool": "aggdec", "spec": spec})


def info(address: str, job_id: str) -> dict:
    details = _client(address).get_job_info(job_id)
    return {"job_id": job_id, "status": str(details.status), "message": details.message,
            "entrypoint": details.entrypoint, "start_time": details.start_time, "end_time": details.end_time}


def logs(address: str, job_id: str) -> str:
    return _client(address).get_job_logs(job_id)


async def tail_logs(address: str, job_id: str):
    async for lines in _client(address).tail_job_logs(job_id):
        yield lines


def stop(address: str, job_id: str) -> bool:
    return _client(address).stop_job(job_id)
