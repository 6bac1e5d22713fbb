"""torchrun's agent health check (TORCHELASTIC_HEALTH_CHECK_PORT) answered over HTTP.

torch defines the interface, :class:`HealthCheckServer` (an alive callback giving the agent's last
progress time, a port, a timeout), and calls it from its agent; the implementation it ships outside
Meta only logs "No health check server started". This one serves it: any GET answers 200 while the
agent made progress within ``timeout`` seconds and 503 after, with a JSON body
``{"alive", "last_progress", "age_s"}``. Like the metrics port it is unauthenticated: it listens on
``observability.metrics_addr`` (127.0.0.1 unless the config says otherwise), with bounded
connections (:mod:`agent.http_endpoint`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from torch.distributed.elastic.agent.server.health_check_server import HealthCheckServer
from torch.distributed.elastic.agent.server.local_elastic_agent import TORCHELASTIC_HEALTH_CHECK_PORT

from agent.config import ConfigError
from agent.http_endpoint import HttpEndpoint, Response

ALIVE_TIMEOUT_S = 60
"""Seconds without progress after which the agent counts as dead (torch's agent uses 60)."""


class HttpHealthCheckServer(HealthCheckServer):
    """torch's HealthCheckServer over HTTP on ``host:port`` (port 0: any free port, see ``port``)."""

    def __init__(self, alive_callback: Callable[[], int], port: int, timeout: int, *, host: str) -> None:
        super().__init__(alive_callback, port, timeout)
        self._host = host
        self._endpoint: HttpEndpoint | None = None

    @property
    def port(self) -> int:
        """The port it listens on once started."""
        return self._endpoint.port if self._endpoint is not None else self._port

    def start(self) -> None:
        try:
            self._endpoint = HttpEndpoint(self._host, self._port, self._respond, name="health-check")
        except OSError as exc:
            raise ConfigError(f"{TORCHELASTIC_HEALTH_CHECK_PORT}={self._port}: cannot listen on {self._host}:"
                              f"{self._port} ({exc.strerror}); pick a free port, or another "
                              "observability.metrics_addr") from exc

    def stop(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None

    def status(self) -> tuple[int, dict[str, object]]:
        """(HTTP status, body) for a probe now."""
        last = self.alive_callback()
        age = time.time() - last
        alive = age <= self._timeout
        return (200 if alive else 503), {"alive": alive, "last_progress": last, "age_s": round(age, 3)}

    def _respond(self) -> Response:
        code, body = self.status()
        return code, "application/json", json.dumps(body).encode()


def from_environment(alive_callback: Callable[[], int], *, host: str) -> HttpHealthCheckServer | None:
    """A started server on the port TORCHELASTIC_HEALTH_CHECK_PORT names, as torchrun reads it (None when unset)."""
    value = os.environ.get(TORCHELASTIC_HEALTH_CHECK_PORT)
    if value is None:
        return None
    if not value.strip().isdigit() or not 0 <= int(value) <= 65535:
        raise ConfigError(f"environment {TORCHELASTIC_HEALTH_CHECK_PORT}={value!r} is not a port (0..65535)")
    server = HttpHealthCheckServer(alive_callback, int(value), ALIVE_TIMEOUT_S, host=host)
    server.start()
    return server
