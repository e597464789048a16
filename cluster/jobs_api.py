"""Ray Jobs API: submit a corpus job to a running cluster, query it, read its logs, stop it.

The job's runtime_env uploads the repository (working_dir = repo root, minus outputs and VCS
files), so the cluster runs this checkout's code; the cluster image must provide the dependencies
(torch, sentencepiece, safetensors, click, pyarrow, ray[data]) or `pip` must list them.
Entry point: `PYTHON -m cli run SPEC ...` (the same as `aggdec run`, without needing the package
installed on the cluster), PYTHON being this interpreter where the cluster runs on this machine
(`local`: the job then runs in the environment it was submitted from, whatever the PATH of the
cluster's processes), and elsewhere `python` from that PATH (`job_python`). Inside the job
RAY_ADDRESS is set, so `run` joins the cluster.
"""

from __future__ import annotations

import asyncio
import ipaddress
import shlex
import socket
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

REPO_ROOT = Path(__file__).resolve().parent.parent
EXCLUDES = [".git", "out", "runs", "bench/results", "**/__pycache__", "*.egg-info", ".pytest_cache", ".whl"]
ANSWER_S = 6.0
"""How long the dashboard may take to answer a short request (the version check that opens every
client, a job's status, a stop, the cluster's nodes) before it is taken to be stuck."""
TRANSFER_S = 120.0
"""The same for a request whose body may be large: a submission (it uploads the working_dir) or a
job's whole log."""
SILENCE_S = 4.0
"""How long `tail_logs` waits for log lines before it asks the dashboard whether it still answers."""


def answered(address: str, what: str, fn, /, *args, seconds: float = ANSWER_S, **kwargs):
    """fn(*args, **kwargs), a request to the cluster at `address`; ConnectionError (one line naming
    the address, `what` went unanswered and what to check) where it has not returned within `seconds`.

    Ray's clients set no timeout on their HTTP requests, so a process that accepts connections and
    never answers (a stuck proxy, a port-forward whose far end is gone, a swapping head) would hold
    them forever. The call runs in a daemon thread, which is left behind when it does not return
    (it cannot be interrupted) and does not keep the process from exiting."""
    box: dict = {}

    def call() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=call, name=f"aggdec-jobs-api: {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise ConnectionError(f"{address}: something accepts connections there but did not answer {what} within "
                              f"{seconds:.0f} s; check that the head node is up and not overloaded, and that any "
                              "proxy or port-forward to it still reaches it")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _client(address: str):
    """Ray's client for the Jobs API at `address`; ConnectionError (one line) where nothing answers
    there (`check_dashboard`), or nothing answers its version check within ANSWER_S (`answered`)."""
    from ray.job_submission import JobSubmissionClient

    from cluster.connection import check_dashboard

    check_dashboard(address)
    return answered(address, "the Jobs API's version check", JobSubmissionClient, address)


def local(address: str) -> bool:
    """Whether the cluster at `address` (http(s)://HOST:PORT, HOST:PORT or 'auto') runs on this
    machine: HOST is this machine (`this_machine`; 'auto' is a cluster started here) and so is the
    head node, by the IP the cluster reports for it (a forwarded port, such as `ray dashboard`'s or
    `kubectl port-forward`'s, is on this machine while the cluster is not). False where the cluster
    does not say; ConnectionError (one line) where nothing answers at a local address (`check_dashboard`)."""
    host = urlsplit(address if "://" in address else f"//{address}").hostname
    if address != "auto" and not (host and this_machine(host)):
        return False
    from ray.util.state import list_nodes

    from cluster.connection import check_dashboard

    check_dashboard(address)  # before Ray's client, which retries for minutes where no cluster answers

    try:
        nodes = answered(address, "a request for its nodes", list_nodes, address=address, detail=True,
                         timeout=ANSWER_S - 1)
    except ConnectionError:
        raise
    except Exception:  # noqa: BLE001 - a cluster that answers the State API with an error: not known to be here
        return False
    return any(node.is_head_node and this_machine(node.node_ip) for node in nodes)


def this_machine(host: str) -> bool:
    """Whether `host` (a name or an IP address) is this machine: a loopback address, or an address of
    one of its interfaces (one it can bind)."""
    try:
        found = socket.getaddrinfo(host, None)
    except OSError:  # a name that does not resolve here
        return False
    for family, _, _, _, sockaddr in found:
        if ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
            return True
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
                return True
            except OSError:
                continue
    return False


def job_python(address: str) -> str:
    """The interpreter a job submitted to `address` runs with: this one (`sys.executable`, the
    environment the user submits from) on a cluster on this machine (`local`); elsewhere `python`,
    the first on the PATH of the cluster's processes."""
    return sys.executable if local(address) else "python"


def runtime_env(pip: list[str] | None = None, working_dir: Path = REPO_ROOT) -> dict:
    env: dict = {"working_dir": str(working_dir), "excludes": list(EXCLUDES)}
    if pip:
        env["pip"] = list(pip)
    return env


def entrypoint(spec: str, run_args: list[str] | tuple[str, ...] = (), python: str = "python") -> str:
    """The shell command the cluster runs: `PYTHON -m cli run SPEC ARGS...` (quoted)."""
    return " ".join(shlex.quote(a) for a in [python, "-m", "cli", "run", spec, *run_args])


def submit(address: str, spec: str, run_args: list[str] | tuple[str, ...] = (), *, pip: list[str] | None = None,
           submission_id: str | None = None, working_dir: Path = REPO_ROOT,
           python: str | None = None) -> tuple[str, str]:
    """Submit `aggdec run SPEC` to the Ray dashboard at `address` (http://HEAD:8265). -> (job id, the
    interpreter the job runs with).

    `spec` is a path relative to the repository root (the job's working directory) or absolute on
    the cluster. `python`: the interpreter the job runs with, default `job_python(address)`. Every
    request is bounded (`answered`): ConnectionError (one line) where the dashboard stops answering.
    """
    client = _client(address)
    python = python or job_python(address)
    job_id = answered(address, "the submission", client.submit_job, seconds=TRANSFER_S,
                      entrypoint=entrypoint(spec, run_args, python), submission_id=submission_id,
                      runtime_env=runtime_env(pip, working_dir), metadata={"tool": "aggdec", "spec": spec})
    return job_id, python


def info(address: str, job_id: str) -> dict:
    details = answered(address, "a request for the job's status", _client(address).get_job_info, job_id)
    return {"job_id": job_id, "status": str(details.status), "message": details.message,
            "entrypoint": details.entrypoint, "start_time": details.start_time, "end_time": details.end_time}


def logs(address: str, job_id: str) -> str:
    return answered(address, "a request for the job's logs", _client(address).get_job_logs, job_id,
                    seconds=TRANSFER_S)


async def tail_logs(address: str, job_id: str, silence_s: float = SILENCE_S):
    """Successive chunks of the job's logs as it writes them, until it ends. After each `silence_s`
    without a chunk the dashboard must answer a status request within ANSWER_S (a job may be quiet;
    its head may not): ConnectionError (one line) where it does not."""
    client = _client(address)
    chunks = aiter(client.tail_job_logs(job_id))
    while True:
        pending = asyncio.ensure_future(anext(chunks))
        while not (await asyncio.wait({pending}, timeout=silence_s))[0]:
            answered(address, f"a status request after {silence_s:.0f} s without log lines", client.get_job_info,
                     job_id)
        try:
            chunk = pending.result()
        except StopAsyncIteration:
            return
        yield chunk


def stop(address: str, job_id: str) -> bool:
    return answered(address, "the stop request", _client(address).stop_job, job_id)
