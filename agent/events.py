"""Recovery events: one JSON object a line, appended to the job's event log.

Every event carries ``time`` (wall clock, seconds since the epoch), ``event``, ``node`` and, from a
worker, ``rank``, ``restart`` (torchrun's restart count) and ``pid``, plus its own fields. Agents and workers of all
nodes may append to one file: each event is a single ``write`` to a file opened with O_APPEND,
so lines never interleave.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from agent.worker import WorkerContext


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
            finally:
                os.close(fd)
        return line


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of a log, in the order written (a torn last line is skipped)."""
    events = []
    with open(path) as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


class Metrics:
    """The agent's Prometheus metrics, served over HTTP when a port is configured (no-ops when not).

    The endpoint is unauthenticated: bind it to a private address (``observability.metrics_addr``).
    """

    def __init__(self, registry: Any | None) -> None:
        self._registry = registry
        if registry is None:
            return
        from prometheus_client import Counter, Gauge

        self._world_size = Gauge("torchrevive_world_size", "World size of the current round", registry=registry)
        self._remaining = Gauge("torchrevive_remaining_restarts", "Worker-failure restarts left", registry=registry)
        self._recoveries = Counter("torchrevive_recoveries", "Membership changes handled, by cause", ["cause"],
                                   registry=registry)

    @classmethod
    def serve(cls, addr: str, port: int | None) -> Metrics:
        """Start the HTTP endpoint on ``addr:port``; without a port, metrics are not kept."""
        if port is None:
            return cls(None)
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        metrics = cls(registry)
        start_http_server(port, addr=addr, registry=registry)
        return metrics

    def set_world_size(self, value: int) -> None:
        if self._registry is not None:
            self._world_size.set(value)

    def set_remaining_restarts(self, value: int) -> None:
        if self._registry is not None:
            self._remaining.set(value)

    def count_recovery(self, cause: str) -> None:
        if self._registry is not None:
            self._recoveries.labels(cause=cause).inc()
