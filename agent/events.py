"""Recovery events: one JSON object a line, appended to the job's event log.

Every event carries ``time`` (wall clock, seconds since the epoch), ``event``, ``node`` and, from a
worker, ``rank``, ``restart`` (torchrun's restart count) and ``pid``, plus its own fields. Agents and workers of all
nodes may append to one file: each event is a single ``write`` to a file opened with O_APPEND,
so lines never interleave. The log is rotated once it reaches :data:`ROTATE_AT_BYTES`; readers
read the rotated files with it (:func:`read_events`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from agent.worker import WorkerContext

ROTATE_AT_BYTES = 64 << 20
"""The size at which the event log is rotated: it becomes ``<log>.1`` (``.1`` becomes ``.2``, and
so on) and writers start a new one."""
ROTATED_KEPT = 4
"""How many rotated files are kept (``<log>.1`` to ``<log>.4``): older events are dropped."""


class EventLog:
    """Appends events to ``path``; with no path, records nothing."""

    def __init__(self, path: str | os.PathLike[str] | None, **identity: Any) -> None:
        self.path = Path(path) if path else None
        self.identity = identity
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_worker(cls, ctx: WorkerContext | None = None) -> EventLog:
        """The event log of this rank, as its agent configured it (TORCHREVIVE_EVENT_LOG)."""
        ctx = ctx or WorkerContext.from_env()
        return cls(ctx.event_log, node=f"{socket.gethostname()}/{ctx.group_rank}", rank=ctx.rank,
                   restart=ctx.restart_count, pid=os.getpid())

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event and return it."""
        line = {"time": time.time(), "event": event, **self.identity, **fields}
        if self.path is not None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(line, default=str) + "\n").encode())
                if os.fstat(fd).st_size >= ROTATE_AT_BYTES:
                    _rotate(self.path, fd)
            finally:
                os.close(fd)
        return line


def _rotate(path: Path, written: int) -> None:
    """Rotate the log ``path``, which the descriptor ``written`` has open and which outgrew
    :data:`ROTATE_AT_BYTES`. Several processes append to it: the rotation holds an flock on
    ``<log>.lock`` and happens only while ``path`` is still that file (another writer may have
    rotated it meanwhile). A writer that still has the old file open appends to ``<log>.1``."""
    lock = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            current = os.stat(path)
        except FileNotFoundError:
            return
        ours = os.fstat(written)
        if (current.st_dev, current.st_ino) != (ours.st_dev, ours.st_ino):
            return
        free = 1  # the first rotated file not there, or the oldest kept (dropped)
        while free < ROTATED_KEPT and rotated(path, free).exists():
            free += 1
        for index in range(free, 1, -1):
            os.replace(rotated(path, index - 1), rotated(path, index))
        os.replace(path, rotated(path, 1))
    finally:
        os.close(lock)  # and with it the flock


def rotated(path: str | os.PathLike[str], index: int) -> Path:
    """The ``index``-th newest rotated file of the log ``path`` (from 1)."""
    path = Path(path)
    return path.with_name(f"{path.name}.{index}")


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of a log, its rotated files' first, in the order written (a torn line is
    skipped). FileNotFoundError when there is no such log."""
    older = []
    while rotated(path, len(older) + 1).exists():
        older.append(rotated(path, len(older) + 1))
    events = []
    for file in [*reversed(older), Path(path)]:
        try:
            with open(file) as f:
                for line in f:
                    try:
                        events.append(json.loads(line))
                    except ValueError:
                        continue
        except FileNotFoundError:  # rotated meanwhile; the log itself only when there is none
            if not older:
                raise
    return events


class Metrics:
    """The agent's Prometheus metrics, served over HTTP when a port is configured (no-ops when not).

    The endpoint is unauthenticated: bind it to a private address (``observability.metrics_addr``).
    """

    def __init__(self, registry: Any | None) -> None:
        self._registry = registry
        self._endpoint: Any | None = None
        """The HTTP endpoint serving them, once :meth:`serve` started it."""
        if registry is None:
            return
        from prometheus_client import Counter, Gauge

        self._world_size = Gauge("torchrevive_world_size", "World size of the current round", registry=registry)
        self._remaining = Gauge("torchrevive_remaining_restarts", "Worker-failure restarts left", registry=registry)
        self._recoveries = Counter("torchrevive_recoveries", "Membership changes handled, by cause", ["cause"],
                                   registry=registry)

    @classmethod
    def serve(cls, addr: str, port: int | None) -> Metrics:
        """Start the HTTP endpoint on ``addr:port``; without a port, metrics are not kept.

        Served by :class:`~agent.http_endpoint.HttpEndpoint`, not prometheus_client's
        ``start_http_server``: that one holds a thread per connection with no timeout and no cap,
        so idle connections to it would pin the agent's threads and descriptors."""
        if port is None:
            return cls(None)
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        from agent.http_endpoint import HttpEndpoint

        registry = CollectorRegistry()
        metrics = cls(registry)
        metrics._endpoint = HttpEndpoint(addr, port, lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
                                         name="metrics")
        return metrics

    def close(self) -> None:
        """Stop serving the metrics (if served)."""
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None

    def set_world_size(self, value: int) -> None:
        if self._registry is not None:
            self._world_size.set(value)

    def set_remaining_restarts(self, value: int) -> None:
        if self._registry is not None:
            self._remaining.set(value)

    def count_recovery(self, cause: str) -> None:
        if self._registry is not None:
            self._recoveries.labels(cause=cause).inc()
