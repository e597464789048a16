"""Connecting to Ray. The only place (with cli.py) that calls ray.init; nothing here runs at import.

`connect(None)` starts an embedded local Ray (no dashboard; a new one even where another Ray runs on
the machine) unless RAY_ADDRESS is set, which is the case inside a job submitted with the Jobs API:
then it joins that cluster. `connect("HOST:6379")`
or `connect("auto")` joins a running cluster.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

RAY_AUTH_LOGGER = "ray._private.authentication"
PROBE_TIMEOUT_S = 5.0
"""How long connecting to a HOST:PORT address may take before the cluster is taken to be unreachable."""


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


def connect(address: str | None = None, *, num_cpus: int | None = None, log_to_driver: bool = True,
            quiet: bool = False) -> Connection:
    """Initialize Ray once. `num_cpus` only applies to an embedded local Ray. `quiet`: Ray's and Ray
    Data's own messages below warnings, its progress bars and its workers' output stay in Ray's log
    directory instead of the terminal. Raises ConnectionError (one line) where a HOST:PORT address
    (or RAY_ADDRESS) accepts no connection within PROBE_TIMEOUT_S, or no cluster runs for 'auto'."""
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
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
    except SystemExit as e:
        if not callable(ours) or e.code != signal.SIGTERM:
            raise
        ray.shutdown()
        signal.signal(signal.SIGTERM, ours)
        ours(signal.SIGTERM, None)
        raise
    if callable(ours):
        signal.signal(signal.SIGTERM, ours)
    return Connection(address=address, resources=ray.cluster_resources(), seconds=time.perf_counter() - t0,
                      started=True)


def check_reachable(address: str) -> None:
    """Raise ConnectionError naming `address` where it has the form [ray://]HOST:PORT and nothing
    accepts a TCP connection there within PROBE_TIMEOUT_S ('auto' and other forms are Ray's)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or "://" in host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        raise ConnectionError(f"{address}: no Ray cluster answers there ({e.strerror or e}); start it, or check "
                              "the address (HOST:PORT of the head's GCS, port 6379 by default)") from None


def disconnect(conn: Connection | None = None) -> None:
    """Shut Ray down if `conn` started it (or unconditionally when conn is None)."""
    import ray

    if conn is None or conn.started:
        ray.shutdown()


def alive_nodes() -> list[dict[str, float]]:
    """The resources ({"CPU": n, "GPU": m, ...}) of every alive node of the connected cluster."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("Ray is not initialized: call cluster.connection.connect() first")
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
