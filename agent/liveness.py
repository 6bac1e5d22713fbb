"""Agent-to-agent connections that tell, at the speed of a closed socket, that a peer's agent died.

When an agent's process dies on a live host, its kernel closes its sockets at once, while its
heartbeat in the rendezvous state lapses only after ``keep_alive_interval`` x
``keep_alive_max_attempt``. Each agent listens on its node's address and, every round, connects to
the next :data:`WATCHED_PEERS` participants in the round's order (so that each node is watched by
that many others, whatever the node count). A connection that ends without the peer's goodbye
means its process is gone: the watcher declares it dead, and the rendezvous drops it for every node
(:class:`~agent.rendezvous.node_ledger.NodeLedger`). A refused connection means the same only for an
address this agent has reached before: one it never reached may name an address that peers cannot
reach (a hostname resolving to a loopback address), and then the heartbeats tell. A frozen or
cut-off node keeps its connections open and is still found by its heartbeats' lapse; a slow one is
never declared.

Nothing but one byte ever crosses these connections, each way it is data: a peer can end a
connection, not run anything. An agent ending on purpose says goodbye first.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

WATCHED_PEERS = 2
"""How many peers each agent watches (and so how many agents watch each node)."""
GOODBYE = b"B"
"""Sent by an agent ending on purpose to every agent watching it."""
FULL = b"F"
"""Sent to a watcher beyond :data:`MAX_WATCHERS`, before its connection is closed."""
MAX_WATCHERS = 64
ADDRESS_KEY = "torchrevive/liveness/{node}"
PUBLISH_WAIT_S = 30.0
"""How long a watcher waits for a peer to publish its address in the round's store."""
CONNECT_TIMEOUT_S = 2.0


def watched_peers(node: str, participants: Sequence[str], count: int = WATCHED_PEERS) -> list[str]:
    """The peers ``node`` watches: the next ``count`` after it in the participants' sorted order."""
    ring = sorted(participants)
    if node not in ring:
        return []
    start = ring.index(node)
    return [ring[(start + step) % len(ring)] for step in range(1, min(count, len(ring) - 1) + 1)]


class PeerLiveness:
    """This agent's side of the liveness connections.

    Args:
        host: the node's address to listen on.
        on_dead: called as ``on_dead(node, when)`` (seconds since the epoch) when a watched peer's
            connection ends without a goodbye, or is refused at an address reached before, from a
            liveness thread.
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
        self._watched: dict[str, socket.socket] = {}
        self._watchers: set[socket.socket] = set()
        self._reached: set[str] = set()
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
        store.set(ADDRESS_KEY.format(node=node), self.address)
        peers = watched_peers(node, participants)
        self._round_stop.set()
        self._round_stop = stop = threading.Event()
        with self._lock:
            for peer in set(self._watched) - set(peers):
                self._pending.append((peer, self._watched.pop(peer)))  # the loop closes it
        self._wake()
        new = [peer for peer in peers if peer not in self._watched]
        if new:
            connector = threading.Thread(target=self._connect, args=(store, new, stop),
                                         name="torchrevive-liveness-connect", daemon=True)
            connector.start()
            self._connectors = [t for t in self._connectors if t.is_alive()] + [connector]

    def close(self) -> None:
        """Say goodbye to every watcher and close every connection; returns once no thread of its
        own is inside a store call (one left there when the process exits aborts it)."""
        if self._closed:
            return
        self._closed = True
        self._round_stop.set()
        for connector in self._connectors:
            connector.join(timeout=CONNECT_TIMEOUT_S + 5)
        self._wake()
        self._thread.join(timeout=5)
        self._wakeup_read.close()
        self._wakeup_write.close()

    # -- the background threads ----------------------------------------------------------------

    def _connect(self, store: Any, peers: list[str], stop: threading.Event) -> None:
        deadline = time.monotonic() + PUBLISH_WAIT_S
        waiting = list(peers)
        try:
            while waiting and not stop.is_set() and time.monotonic() < deadline:
                for peer in [p for p in waiting if store.check([ADDRESS_KEY.format(node=p)])]:
                    waiting.remove(peer)
                    self._watch(peer, store.get(ADDRESS_KEY.format(node=peer)).decode(), stop)
                stop.wait(0.05)
        except Exception as exc:  # the round's store is gone (its host died): the heartbeats tell
            logger.warning("cannot read the liveness addresses of %s from the round's store (%s); their loss will "
                           "be seen from their heartbeats", ", ".join(waiting), exc)

    def _watch(self, peer: str, address: str, stop: threading.Event) -> None:
        host, _, port = address.rpartition(":")
        try:
            connection = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S)
        except ConnectionRefusedError:
            if address in self._reached:  # reached before, listening no more: the agent is gone
                self._on_dead(peer, time.time())
            else:
                logger.warning("the agent of %s refused a liveness connection at %s, an address never reached; its "
                               "loss will be seen from its heartbeats (is it an address its peers can reach?)",
                               peer, address)
            return
        except OSError as exc:  # unreachable: the heartbeats tell
            logger.warning("cannot watch the agent of %s at %s (%s); its loss will be seen from its heartbeats",
                           peer, address, exc)
            return
        self._reached.add(address)
        connection.setblocking(False)
        with self._lock:
            if stop.is_set():
                connection.close()
                return
            self._watched[peer] = connection
            self._pending.append((peer, connection))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wakeup_write.send(b"\0")
        except BlockingIOError:  # a wake-up is already pending
            pass

    def _serve(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select():
                kind, peer = key.data
                try:
                    if kind == "listener":
                        self._accept()
                    elif kind == "wakeup":
                        self._wakeup_read.recv(4096)
                        self._apply_pending()
                    elif kind == "watcher":
                        self._on_watcher(key.fileobj)
                    else:
                        self._on_watched(peer, key.fileobj)
                except OSError as exc:  # one socket's trouble must not end the liveness thread
                    logger.warning("liveness %s socket: %s", kind, exc)
                    if kind in ("watcher", "watched"):
                        self._watchers.discard(key.fileobj)
                        self._drop(key.fileobj)
        self._say_goodbye()

    def _accept(self) -> None:
        try:
            connection, _ = self._listener.accept()
        except BlockingIOError:
            return
        if len(self._watchers) >= MAX_WATCHERS:
            with contextlib.suppress(OSError):  # gone already
                connection.send(FULL)
            connection.close()
            return
        connection.setblocking(False)
        self._watchers.add(connection)
        self._selector.register(connection, selectors.EVENT_READ, ("watcher", ""))

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for peer, connection in pending:
            if self._watched.get(peer) is connection:
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
        try:
            data = connection.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        with self._lock:
            if self._watched.get(peer) is connection:
                del self._watched[peer]
        self._drop(connection)
        if not data:  # closed without a goodbye, or reset: its process is gone
            self._on_dead(peer, time.time())
        elif GOODBYE not in data and FULL not in data:
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
        for connection in [*self._watchers, *self._watched.values(), *pending, self._listener]:
            connection.close()
        self._selector.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
