"""A small read-only HTTP endpoint with bounded connections, for the agent's health check and
Prometheus metrics: every GET gets what one function returns, and a client gets
:data:`~agent.listener_limits.HANDSHAKE_TIMEOUT_S` seconds for its whole exchange, within the caps of
:class:`~agent.listener_limits.ConnectionCaps` (so idle or slow connections cannot pin the
agent's threads and descriptors). Unauthenticated: it listens on the address its caller names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from agent.listener_limits import BoundedServerMixin, ConnectionCaps

MAX_CONNECTIONS = 32
"""Connections an endpoint holds at once (a scraper or a probe needs one)."""
MAX_CONNECTIONS_PER_ADDRESS = 8

Response = tuple[int, str, bytes]
"""(HTTP status, content type, body)."""


class _BoundedHTTPServer(BoundedServerMixin, ThreadingHTTPServer):
    pass


class HttpEndpoint:
    """Serves ``respond()`` to every GET on ``host:port`` (port 0: any free one, see :attr:`port`)
    from a thread of its own. Raises OSError when it cannot listen there.

    Args:
        host: the address to listen on.
        port: the port.
        respond: makes the answer to a GET, from a connection's thread.
        name: the endpoint's name, for its threads and log lines.
    """

    def __init__(self, host: str, port: int, respond: Callable[[], Response], *, name: str) -> None:
        handler = _handler_class(respond)
        self._httpd = _BoundedHTTPServer((host, port), handler, bind_and_activate=False)
        self._httpd.bound(ConnectionCaps(f"the {name} endpoint", total=MAX_CONNECTIONS,
                                         per_address=MAX_CONNECTIONS_PER_ADDRESS))
        try:
            self._httpd.server_bind()
            self._httpd.server_activate()
        except OSError:
            self._httpd.server_close()
            raise
        threading.Thread(target=self._httpd.serve_forever, name=f"torchrevive-{name}", daemon=True).start()

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._httpd.server_address[1])

    def close(self) -> None:
        """Stop serving and close the listener."""
        self._httpd.shutdown()
        self._httpd.server_close()


def _handler_class(respond: Callable[[], Response]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            code, content_type, body = respond()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: no log line each
            pass

    return Handler
