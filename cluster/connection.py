"""Connecting to Ray. The only place (with cli.py) that calls ray.init; nothing here runs at import.

`connect(None)` starts an embedded local Ray (no dashboard; a new one even where another Ray runs on
the machine, whose processes end with this one however it ends: `cluster.reaper`) unless
RAY_ADDRESS is set, which is the case inside a job submitted with the Jobs API:
then it joins that cluster. `connect("HOST:6379")`
or `connect("auto")` joins a running cluster.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from cluster.reaper import release, watch

RAY_AUTH_LOGGER = "ray._private.authentication"
PROBE_TIMEOUT_S = 5.0
"""How long connecting to a HOST:PORT address, and then its answer, may take before the cluster is
taken to be unreachable."""


def quiet_ray() -> None:
    """Keep Ray's and Ray Data's informational output off the terminal (it stays in Ray's logs), and
    Ray Data's reports of a failed execution (a traceback of, e.g., an actor lost with its node):
    the exception reaches the job, which says in one line what it does about it."""
    for name in ("ray", "ray.data", "ray.data._internal"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from ray.data import DataContext

    DataContext.get_current().print_on_execution_start = False
    for handler in logging.getLogger("ray.data").handlers:  # the console handler; ray-data.log keeps everything
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            if not any(isinstance(f, _ExecutionFailures) for f in handler.filters):
                handler.addFilter(_ExecutionFailures())


class _ExecutionFailures(logging.Filter):
    """Hides Ray Data's console records of a failed execution: those that carry the exception the
    execution then raises to the driver, those that announce it, and the one that gives up on actors
    dying as they start."""

    HIDDEN = ("failing execution", "An exception was raised from a task of operator", "Exception occurred in user code")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info or any(text in record.getMessage() for text in self.HIDDEN))


@dataclass(frozen=True)
class Connection:
    address: str | None  # None: embedded local Ray started by this process
    resources: dict[str, float]  # ray.cluster_resources() at connect time
    seconds: float  # time spent in ray.init (0 when Ray was already initialized)
    started: bool  # this call started Ray (so disconnect() should stop it)
    reaper: subprocess.Popen | None = None  # of a local Ray this call started (cluster.reaper)


def connect(address: str | None = None, *, num_cpus: int | None = None, log_to_driver: bool = True,
            quiet: bool = False) -> Connection:
    """Initialize Ray once. `num_cpus` only applies to an embedded local Ray. `quiet`: Ray's and Ray
    Data's own messages below warnings, its progress bars and its workers' output stay in Ray's log
    directory instead of the terminal. Raises ConnectionError (one line) where no Ray cluster answers
    at a HOST:PORT address (or RAY_ADDRESS; `check_reachable`), or no cluster runs for 'auto'."""
    import ray

    if quiet:
        quiet_ray()
    if ray.is_initialized():
        return Connection(address=address, resources=ray.cluster_resources(), seconds=0.0, started=False)
    t0 = time.perf_counter()
    kwargs = {"log_to_driver": log_to_driver and not quiet, "logging_level": logging.WARNING if quiet else logging.INFO}
    # ray.init replaces the SIGTERM handler with its own (sys.exit(15)); a handler the caller set
    # (cli.py: stop cleanly, exit status 143) is put back, and gets a SIGTERM that ends ray.init
    ours = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    reaper = None
    try:
        if address or os.environ.get("RAY_ADDRESS"):
            check_reachable(address or os.environ["RAY_ADDRESS"])  # ray.init would retry for minutes
            ray.init(address=address, **kwargs)
        else:
            # Ray turns token authentication on for a local cluster it starts and warns about it at
            # every start; for an embedded Ray that only this process uses that warning is noise (its
            # choice stands: RAY_AUTH_MODE still decides).
            logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)
            # "local": a new instance, never a cluster another process started on this machine (which
            # ray.init() without an address would join, recorded in Ray's temp directory)
            context = ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
            reaper = watch(context.address_info["session_dir"])
    except SystemExit as e:
        if not callable(ours) or e.code != signal.SIGTERM:
            raise
        ray.shutdown()
        release(reaper)
        signal.signal(signal.SIGTERM, ours)
        ours(signal.SIGTERM, None)
        raise
    if callable(ours):
        signal.signal(signal.SIGTERM, ours)
    return Connection(address=address, resources=ray.cluster_resources(), seconds=time.perf_counter() - t0,
                      started=True, reaper=reaper)


def check_reachable(address: str) -> None:
    """Raise ConnectionError (one line, naming `address`) unless a Ray cluster answers at `address`
    within about 2 x PROBE_TIMEOUT_S: for HOST:PORT, a TCP connection and then the GCS's answer to a
    request for the cluster's id (an address where something else answers, such as a dashboard's
    port, would have ray.init retry for minutes, its log lines on the terminal); for ray://HOST:PORT
    (Ray Client), a TCP connection. An http(s):// address (a dashboard's) is refused; 'auto' and
    other forms are Ray's."""
    if address.startswith(("http://", "https://")):
        raise ConnectionError(f"{address}: a dashboard's address (aggdec submit, status, logs, stop); a job joins "
                              "a cluster at HOST:PORT of the head's GCS (port 6379 by default)")
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or "://" in host:
        return
    host = host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        raise ConnectionError(f"{address}: no Ray cluster answers there ({e.strerror or e}); start it, or check "
                              "the address (HOST:PORT of the head's GCS, port 6379 by default)") from None
    other = None if address.startswith("ray://") else _not_a_gcs(host, int(port))
    if other == "DEADLINE_EXCEEDED":
        raise ConnectionError(f"{address}: something accepts connections there but did not answer a request for the "
                              f"cluster's id within {PROBE_TIMEOUT_S:.0f} s; check that the head node is up and not "
                              "overloaded, that any proxy or port-forward to it still reaches it, and the address "
                              "(HOST:PORT of the head's GCS, port 6379 by default)")
    if other:
        raise ConnectionError(f"{address}: something answers there, but not a Ray cluster's GCS (gRPC {other}); check "
                              "the address (HOST:PORT of the head's GCS, port 6379 by default)")


def check_dashboard(address: str) -> None:
    """For the Jobs API: raise ConnectionError (one line, naming `address`) where `address`,
    http(s)://HOST[:PORT], accepts no TCP connection within PROBE_TIMEOUT_S (Ray's client would wait
    for the operating system's timeout); any other address is a cluster's, whose dashboard Ray's
    client looks up through its GCS: `check_reachable`."""
    if not address.startswith(("http://", "https://")):
        check_reachable(address)
        return
    url = urlsplit(address)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        socket.create_connection((url.hostname or "", port), timeout=PROBE_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"{address}: no Ray dashboard answers there ({getattr(e, 'strerror', None) or e}); "
                              "start the cluster, or check the address (http://HEAD:8265 by default)") from None


def _not_a_gcs(host: str, port: int) -> str | None:
    """None where a Ray GCS answers at host:port within PROBE_TIMEOUT_S (an authentication error is
    its answer too), else the name of the gRPC status that came instead (DEADLINE_EXCEEDED: nothing
    answered). Not checked (None) where Ray uses TLS."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)]) as channel:  # as Ray connects
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return e.code().name
    return None


def disconnect(conn: Connection | None = None) -> None:
    """Shut Ray down if `conn` started it (or unconditionally when conn is None)."""
    import ray

    if conn is None or conn.started:
        ray.shutdown()
    if conn is not None:
        release(conn.reaper)


def alive_nodes() -> list[dict[str, float]]:
    """The resources ({"CPU": n, "GPU": m, ...}) of every alive node of the connected cluster."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialized: call cluster.connection.connect() first")
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
