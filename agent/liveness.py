"""Agent-to-agent connections that tell, at the speed of a closed socket, that a peer's agent died.

When an agent's process dies on a live host, its kernel closes its sockets at once, while its
heartbeat in the rendezvous state lapses only after ``keep_alive_interval`` x
``keep_alive_max_attempt``. Each agent listens on its node's address and, every round, connects to
the next :data:`WATCHED_PEERS` participants in the round's order (so that each node is watched by
that many others, whatever the node count). A connection that ends without the peer's goodbye is
checked once: the watcher connects to the same address again at once, and only when that fails is
the peer's process gone: the watcher declares it dead, and the rendezvous drops it for every node
(:class:`~agent.rendezvous.node_ledger.NodeLedger`). A connection reset on the way (its peer still
listening) is so told from a death. A refused connection means the same only for an address this
agent has reached before: one it never reached may name an address that peers cannot reach (a
hostname resolving to a loopback address), and then the heartbeats tell. A frozen or cut-off node
keeps its connections open and is still found by its heartbeats' lapse; a slow one is never
declared.

The listener serves strangers before they are anything: a new connection must name, within
:data:`~agent.listener_limits.HANDSHAKE_TIMEOUT_S`, the node it watches (:data:`HELLO`) or it is
cut; until then it counts against caps per peer address and in total
(:class:`~agent.listener_limits.ConnectionCaps`), beyond which connections are refused at once. So
idle connections drain, and a watcher refused meanwhile (told :data:`FULL`) tries again a moment
later: a flood delays fast death detection, it cannot turn it off. A published address comes from
the round's store, which anyone reaching it can write: a watcher connects only to an IP address and
port, at the address the rendezvous knows for the node where its name carries one.

Nothing but a hello and one byte ever crosses these connections, each way it is data: a peer can
end a connection, not run anything. An agent ending on purpose says goodbye first.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agent import listener_limits
from agent.listener_limits import ConnectionCaps, LogThrottle

logger = logging.getLogger(__name__)

WATCHED_PEERS = 2
"""How many peers each agent watches (and so how many agents watch each node)."""
HELLO = b"H"
"""A watcher's first bytes: ``HELLO``, the name of the node it watches, a newline."""
GOODBYE = b"B"
"""Sent by an agent ending on purpose to every agent watching it."""
FULL = b"F"
"""Sent to a connection refused for now (beyond a cap, or silent past its deadline), before it is
closed: the watcher tries again."""
NOT_WATCHED = b"N"
"""Sent to a connection whose hello names another node (an address now another agent's), before it is closed."""
MAX_WATCHERS = 64
"""Watchers (connections that said hello) held at once."""
MAX_UNPROVEN = 64
"""Connections that have not said hello yet, held at once."""
MAX_UNPROVEN_PER_ADDRESS = 16
MAX_HELLO_BYTES = 512
ADDRESS_KEY = "torchrevive/liveness/{node}"
PUBLISH_WAIT_S = 30.0
"""How long a watcher waits for a peer to publish its address in the round's store."""
CONNECT_TIMEOUT_S = 2.0
RETRY_S = 1.0
"""How long a watcher told :data:`FULL` waits before it tries again."""
_RENDEZVOUS_NAME = re.compile(r"^(?P<addr>.+)_\d+_\d+$")
"""torch's name of a node in the rendezvous state: ``addr_pid_localid``."""


def watched_peers(node: str, participants: Sequence[str], count: int = WATCHED_PEERS) -> list[str]:
    """The peers ``node`` watches: the next ``count`` after it in the participants' sorted order."""
    ring = sorted(participants)
    if node not in ring:
        return []
    start = ring.index(node)
    return [ring[(start + step) % len(ring)] for step in range(1, min(count, len(ring) - 1) + 1)]


def checked_address(node: str, published: str) -> tuple[str, int]:
    """The (IP, port) to watch ``node`` at, from the ``host:port`` it published in the round's store
    (which anyone reaching the store can write). ValueError unless the host is a unicast IP address
    (an agent publishes the address its listener is bound to) and the port 1..65535, and, where
    ``node`` is named as torch names it (``addr_pid_localid``), ``addr`` resolves to that IP."""
    host, colon, port = published.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{published!r} is not host:port with a port in 1..65535")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{published!r} does not name an IP address") from None
    if ip.is_unspecified or ip.is_multicast:
        raise ValueError(f"{published!r} is not the address of one host")
    name = _RENDEZVOUS_NAME.match(node)
    if name is not None:
        known = name.group("addr")
        try:
            resolved = {ipaddress.ip_address(info[4][0].split("%")[0])
                        for info in socket.getaddrinfo(known, None, type=socket.SOCK_STREAM)}
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot resolve {known}, the rendezvous' address of {node}, to check {published!r} "
                             f"against it ({exc})") from None
        if ip not in resolved:
            raise ValueError(f"{published!r} is not an address of {known}, where the rendezvous knows {node} "
                             f"({', '.join(sorted(map(str, resolved)))})")
    return str(ip), int(port)


@dataclass
class _Watch:
    """A connection to a watched peer's listener."""

    connection: socket.socket
    address: tuple[str, int]
    stop: threading.Event
    """Set when the round it was made for ends."""


@dataclass
class _Unproven:
    """A connection to this agent's listener that has not said hello yet."""

    address: str
    deadline: float
    received: bytes = b""


class PeerLiveness:
    """This agent's side of the liveness connections.

    Args:
        host: the node's address to listen on.
        on_dead: called as ``on_dead(node, when)`` (seconds since the epoch) when a watched peer's
            connection ends without a goodbye and the peer no longer listens, or is refused at an
            address reached before, from a liveness thread.
    """

    def __init__(self, host: str, on_dead: Callable[[str, float], None]) -> None:
        self._on_dead = on_dead
        self._listener = socket.create_server((host, 0), family=_family(host))
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._wakeup_read, self._wakeup_write = socket.socketpair()
        self._wakeup_write.setblocking(False)
        self._lock = threading.Lock()
        self._pending: list[tuple[str, socket.socket]] = []
        self._watched: dict[str, _Watch] = {}
        self._node: str | None = None
        """This agent's node, as its watchers name it in their hello (known from the first round)."""
        self._caps = ConnectionCaps(f"the liveness listener on {self.address}", total=MAX_UNPROVEN,
                                    per_address=MAX_UNPROVEN_PER_ADDRESS)
        self._unproven: dict[socket.socket, _Unproven] = {}
        self._strangers_log = LogThrottle()
        self._watchers: set[socket.socket] = set()
        self._reached: set[tuple[str, int]] = set()
        """Addresses a connection of this agent's was accepted at."""
        self._round_stop = threading.Event()
        self._connectors: list[threading.Thread] = []
        self._closed = False
        self._selector.register(self._listener, selectors.EVENT_READ, ("listener", ""))
        self._selector.register(self._wakeup_read, selectors.EVENT_READ, ("wakeup", ""))
        self._thread = threading.Thread(target=self._serve, name="torchrevive-liveness", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """Where this agent listens, as published to its watchers (``host:port``)."""
        host, port = self._listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start_round(self, store: Any, node: str, participants: Sequence[str]) -> None:
        """Publish this agent's address in the round's ``store`` and, in the background, connect
        to the peers it watches in this round (dropping the connections to those it no longer
        watches)."""
        self._node = node  # before the address is out: a watcher's hello names it
        store.set(ADDRESS_KEY.format(node=node), self.address)
        peers = watched_peers(node, participants)
        self._round_stop.set()
        self._round_stop = stop = threading.Event()
        with self._lock:
            for peer in set(self._watched) - set(peers):
                self._pending.append((peer, self._watched.pop(peer).connection))  # the loop closes it
        self._wake()
        new = [peer for peer in peers if peer not in self._watched]
        if new:
            self._start_connector(self._connect, store, new, stop)

    def close(self) -> None:
        """Say goodbye to every watcher and close every connection; returns once no thread of its
        own is inside a store call (one left there when the process exits aborts it)."""
        with self._lock:  # from here on no connector starts: those running are joined below
            if self._closed:
                return
            self._closed = True
            connectors = list(self._connectors)
        self._round_stop.set()
        for connector in connectors:
            connector.join(timeout=CONNECT_TIMEOUT_S + 5)
        self._wake()
        self._thread.join(timeout=5)
        self._wakeup_read.close()
        self._wakeup_write.close()

    # -- the connecting threads ----------------------------------------------------------------

    def _start_connector(self, target: Callable[..., None], *args: Any) -> None:
        connector = threading.Thread(target=target, args=args, name="torchrevive-liveness-connect", daemon=True)
        with self._lock:
            if self._closed:
                return
            self._connectors = [t for t in self._connectors if t.is_alive()] + [connector]
        connector.start()

    def _connect(self, store: Any, peers: list[str], stop: threading.Event) -> None:
        deadline = time.monotonic() + PUBLISH_WAIT_S
        waiting = list(peers)
        try:
            while waiting and not stop.is_set() and time.monotonic() < deadline:
                for peer in [p for p in waiting if store.check([ADDRESS_KEY.format(node=p)])]:
                    waiting.remove(peer)
                    published = store.get(ADDRESS_KEY.format(node=peer)).decode(errors="replace")
                    try:
                        address = checked_address(peer, published)
                    except ValueError as exc:
                        logger.warning("not watching the agent of %s: its liveness address in the round's store: %s; "
                                       "its loss will be seen from its heartbeats", peer, exc)
                        continue
                    self._watch(peer, address, stop)
                stop.wait(0.05)
        except Exception as exc:  # the round's store is gone (its host died): the heartbeats tell
            logger.warning("cannot read the liveness addresses of %s from the round's store (%s); their loss will "
                           "be seen from their heartbeats", ", ".join(waiting), exc)

    def _watch(self, peer: str, address: tuple[str, int], stop: threading.Event) -> None:
        try:
            connection = self._connect_to(peer, address)
        except ConnectionRefusedError:
            if address in self._reached:  # reached before, listening no more: the agent is gone
                self._on_dead(peer, time.time())
            else:
                logger.warning("the agent of %s refused a liveness connection at %s:%d, an address never reached; "
                               "its loss will be seen from its heartbeats (is it an address its peers can reach?)",
                               peer, *address)
            return
        except OSError as exc:  # unreachable: the heartbeats tell
            logger.warning("cannot watch the agent of %s at %s:%d (%s); its loss will be seen from its heartbeats",
                           peer, *address, exc)
            return
        self._adopt(peer, _Watch(connection, address, stop))

    def _recheck(self, peer: str, watch: _Watch, closed_at: float) -> None:
        """The connection to ``peer`` ended without a goodbye: dead unless it listens still."""
        try:
            connection = self._connect_to(peer, watch.address)
        except OSError:  # nothing listens there any more: its process is gone
            self._on_dead(peer, closed_at)
            return
        logger.info("the liveness connection to the agent of %s ended without a goodbye, but it listens still: "
                    "watching it again", peer)
        self._adopt(peer, _Watch(connection, watch.address, watch.stop))

    def _retry(self, peer: str, watch: _Watch) -> None:
        """``peer``'s listener refused the connection for now (a flood holding its room): again in a moment."""
        if not watch.stop.wait(RETRY_S):
            self._watch(peer, watch.address, watch.stop)

    def _connect_to(self, peer: str, address: tuple[str, int]) -> socket.socket:
        connection = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
        try:
            connection.sendall(HELLO + peer.encode() + b"\n")
        except OSError:
            connection.close()
            raise
        self._reached.add(address)
        connection.setblocking(False)
        return connection

    def _adopt(self, peer: str, watch: _Watch) -> None:
        """Watch ``peer`` through ``watch`` from the loop, unless its round ended meanwhile."""
        with self._lock:
            if watch.stop.is_set():
                watch.connection.close()
                return
            self._watched[peer] = watch
            self._pending.append((peer, watch.connection))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wakeup_write.send(b"\0")
        except BlockingIOError:  # a wake-up is already pending
            pass

    # -- the loop --------------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select(timeout=self._next_deadline()):
                kind, peer = key.data
                try:
                    if kind == "listener":
                        self._accept()
                    elif kind == "wakeup":
                        self._wakeup_read.recv(4096)
                        self._apply_pending()
                    elif kind == "unproven":
                        self._on_unproven(key.fileobj)
                    elif kind == "watcher":
                        self._on_watcher(key.fileobj)
                    else:
                        self._on_watched(peer, key.fileobj)
                except OSError as exc:  # one socket's trouble must not end the liveness thread
                    logger.warning("liveness %s socket: %s", kind, exc)
                    if kind == "unproven":
                        self._refuse(key.fileobj, b"")
                    elif kind in ("watcher", "watched"):
                        self._watchers.discard(key.fileobj)
                        self._drop(key.fileobj)
            self._cut_late()
        self._say_goodbye()

    def _next_deadline(self) -> float | None:
        if not self._unproven:
            return None
        return max(0.0, min(u.deadline for u in self._unproven.values()) - time.monotonic())

    def _accept(self) -> None:
        try:
            connection, peer_address = self._listener.accept()
        except BlockingIOError:
            return
        address = str(peer_address[0])
        if not self._caps.admit(address):  # before it costs more than its descriptor, for a moment
            with contextlib.suppress(OSError):  # gone already
                connection.send(FULL)
            connection.close()
            return
        connection.setblocking(False)
        self._unproven[connection] = _Unproven(address, time.monotonic() + listener_limits.HANDSHAKE_TIMEOUT_S)
        self._selector.register(connection, selectors.EVENT_READ, ("unproven", ""))

    def _on_unproven(self, connection: Any) -> None:
        try:
            data = connection.recv(MAX_HELLO_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        unproven = self._unproven[connection]
        unproven.received += data
        hello, newline, _ = unproven.received.partition(b"\n")
        if not data:
            self._refuse(connection, b"")
        elif not newline:
            if len(unproven.received) > MAX_HELLO_BYTES:
                self._refuse(connection, NOT_WATCHED)
        elif self._node is None or hello != HELLO + self._node.encode():
            if count := self._strangers_log.event():
                logger.warning("%d liveness connection(s) named another node than this agent's (the last from %s: "
                               "%r): watchers of an agent that listened here before, or not agents", count,
                               unproven.address, hello[:64])
            self._refuse(connection, NOT_WATCHED)
        elif len(self._watchers) >= MAX_WATCHERS:
            self._refuse(connection, FULL)
        else:
            self._caps.release(self._unproven.pop(connection).address)
            self._selector.modify(connection, selectors.EVENT_READ, ("watcher", ""))
            self._watchers.add(connection)

    def _cut_late(self) -> None:
        """Refuse the connections that said no hello by their deadline: a flood drains."""
        now = time.monotonic()
        for connection in [c for c, u in self._unproven.items() if u.deadline <= now]:
            self._refuse(connection, FULL)

    def _refuse(self, connection: socket.socket, reason: bytes) -> None:
        self._caps.release(self._unproven.pop(connection).address)
        if reason:
            with contextlib.suppress(OSError):
                connection.send(reason)
        self._drop(connection)

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for peer, connection in pending:
            watch = self._watched.get(peer)
            if watch is not None and watch.connection is connection:
                self._selector.register(connection, selectors.EVENT_READ, ("watched", peer))
            else:  # no longer watched
                self._drop(connection)

    def _on_watcher(self, connection: Any) -> None:
        try:
            data = connection.recv(64)
        except OSError:
            data = b""
        if not data:  # the watcher moved on (or died: its own watchers tell)
            self._watchers.discard(connection)
            self._drop(connection)

    def _on_watched(self, peer: str, connection: Any) -> None:
        closed_at = time.time()
        try:
            data = connection.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        with self._lock:
            watch = self._watched.get(peer)
            if watch is None or watch.connection is not connection:
                watch = None
            else:
                del self._watched[peer]
        self._drop(connection)
        if watch is None:
            return
        if not data:  # closed without a goodbye, or reset: gone, unless it listens still
            self._start_connector(self._recheck, peer, watch, closed_at)
        elif FULL in data:
            self._start_connector(self._retry, peer, watch)
        elif NOT_WATCHED in data:
            logger.warning("the liveness listener at %s:%d is not the agent of %s's any more; its loss will be seen "
                           "from its heartbeats", *watch.address, peer)
        elif GOODBYE not in data:
            logger.warning("the agent of %s sent %r on its liveness connection, which agents never send; no "
                           "longer watching it (its heartbeats still tell)", peer, data[:16])

    def _drop(self, connection: socket.socket) -> None:
        try:
            self._selector.unregister(connection)
        except (KeyError, ValueError):
            pass
        connection.close()

    def _say_goodbye(self) -> None:
        for connection in self._watchers:
            try:
                connection.send(GOODBYE)
            except OSError:
                pass
        with self._lock:
            pending = [connection for _, connection in self._pending]
            watched = [watch.connection for watch in self._watched.values()]
        for connection in [*self._watchers, *self._unproven, *watched, *pending, self._listener]:
            connection.close()
        self._selector.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
