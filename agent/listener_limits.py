"""Bounds on what a stranger can hold of an agent's listeners: connection caps, in total and per
peer address, enforced before any thread or work is spent on a connection, and a deadline on
each connection until it proves itself.

Every agent listener (the memory tier's data plane, the liveness listener, the health check and
the metrics endpoint) is reachable by anyone on its network before authentication. Without
bounds, idle connections pin a thread and a descriptor each until the agent runs out of both. With
them a flood is refused at the door once its share is spent, a connection that does not finish
its handshake (or, for HTTP, its whole exchange) within the deadline is cut, and so a flood drains
and the listener goes on serving its legitimate peers. A refusal is logged, at most one line per
:data:`LOG_INTERVAL_S` and listener.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
"""At most one log line per this many seconds and listener about refused connections."""
HANDSHAKE_TIMEOUT_S = 10.0
"""Seconds a connection has, from its accept, to prove itself (the data plane's mutual proof of the
secret) or, for an HTTP endpoint, to finish its whole request and answer."""
IDLE_TIMEOUT_S = 60.0
"""Seconds an authenticated connection may stay silent in the middle of an exchange, or between
two requests, before it is closed."""


class LogThrottle:
    """Lets one log line through per :data:`LOG_INTERVAL_S`, and counts the events it held back. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._last = float("-inf")

    def event(self) -> int:
        """Count one event; how many to report in a line now (0: stay quiet)."""
        with self._lock:
            self._count += 1
            if time.monotonic() - self._last < LOG_INTERVAL_S:
                return 0
            count, self._count, self._last = self._count, 0, time.monotonic()
            return count


class ConnectionCaps:
    """How many connections a listener holds at once: at most ``total``, at most ``per_address``
    from one peer address. Thread-safe.

    Args:
        listener: the listener's name, for the log line of a refusal.
        total: connections held at once, from all addresses.
        per_address: connections held at once from one peer address.
    """

    def __init__(self, listener: str, *, total: int, per_address: int) -> None:
        if not 0 < per_address <= total:
            raise ValueError(f"{listener}: caps of {per_address} per address and {total} in total")
        self.listener, self.total, self.per_address = listener, total, per_address
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._log = LogThrottle()

    def admit(self, address: str) -> bool:
        """Count a new connection from ``address`` in, or refuse it (False, logged) when a cap is reached."""
        with self._lock:
            held = self._held.get(address, 0)
            if held < self.per_address and sum(self._held.values()) < self.total:
                self._held[address] = held + 1
                return True
            count = self._log.event()
            from_address, from_all = held, sum(self._held.values())
        if count:
            logger.warning("%s: refused %d connection(s) (the last from %s, which holds %d of %d per address; %d of "
                           "%d in total are held); a flood of connections, or raise the caps", self.listener, count,
                           address, from_address, self.per_address, from_all, self.total)
        return False

    def release(self, address: str) -> None:
        """A connection :meth:`admit` counted in has ended."""
        with self._lock:
            held = self._held[address] - 1
            if held:
                self._held[address] = held
            else:
                del self._held[address]


class BoundedServerMixin:
    """A threading ``socketserver`` server that refuses connections beyond its :class:`ConnectionCaps`
    before a thread is started for them, and cuts a connection still unproven at its
    :data:`HANDSHAKE_TIMEOUT_S` deadline; every accepted socket reads and writes with a timeout of
    ``idle_timeout_s``. A handler calls :meth:`proven` once its peer has authenticated (an HTTP
    handler never does: its whole exchange must fit the deadline)."""

    caps: ConnectionCaps
    handshake_timeout_s: float
    idle_timeout_s: float
    daemon_threads = True

    def bound(self, caps: ConnectionCaps, *, handshake_timeout_s: float | None = None,
              idle_timeout_s: float | None = None) -> None:
        """Set the caps and timeouts, in seconds (None: :data:`HANDSHAKE_TIMEOUT_S`,
        :data:`IDLE_TIMEOUT_S`); call before serving."""
        self.caps = caps
        self.handshake_timeout_s = HANDSHAKE_TIMEOUT_S if handshake_timeout_s is None else handshake_timeout_s
        self.idle_timeout_s = IDLE_TIMEOUT_S if idle_timeout_s is None else idle_timeout_s
        self._admitted: dict[socket.socket, str] = {}
        self._deadlines: dict[socket.socket, float] = {}
        self._admitted_lock = threading.Lock()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """socketserver calls it on the accepting thread, before any thread of the connection's."""
        address = str(client_address[0])
        if not self.caps.admit(address):
            return False
        request.settimeout(min(self.handshake_timeout_s, self.idle_timeout_s))
        with self._admitted_lock:
            self._admitted[request] = address
            self._deadlines[request] = time.monotonic() + self.handshake_timeout_s
        return True

    def proven(self, request: socket.socket) -> None:
        """``request``'s peer authenticated: no deadline for it any more, the idle timeout only."""
        request.settimeout(self.idle_timeout_s)
        with self._admitted_lock:
            self._deadlines.pop(request, None)

    def service_actions(self) -> None:
        """Cut the connections past their deadline (serve_forever calls it every poll interval); a
        handler blocked on one then sees it closed and ends."""
        now = time.monotonic()
        with self._admitted_lock:
            late = [request for request, deadline in self._deadlines.items() if deadline <= now]
            for request in late:
                del self._deadlines[request]
        for request in late:
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile
                pass
        super().service_actions()  # type: ignore[misc]

    def shutdown_request(self, request: Any) -> None:
        with self._admitted_lock:
            address = self._admitted.pop(request, None)
            self._deadlines.pop(request, None)
        if address is not None:
            self.caps.release(address)
        super().shutdown_request(request)  # type: ignore[misc]


class BoundedThreadingTCPServer(BoundedServerMixin, socketserver.ThreadingTCPServer):
    """A ``ThreadingTCPServer`` with caps and deadlines (:class:`BoundedServerMixin`)."""

    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[socketserver.BaseRequestHandler],
                 caps: ConnectionCaps) -> None:
        self.bound(caps)
        super().__init__(address, handler)
