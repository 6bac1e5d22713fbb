"""What one agent knows of every node's liveness, kept beside torch's dynamic rendezvous state.

torch's ``DynamicRendezvousHandler`` keeps each node's last heartbeat in the shared state, and its
clean-up (run after every sync of that state) drops a node whose heartbeat is older than
``keep_alive_interval`` x ``keep_alive_max_attempt``. A node that leaves a round by itself (its
agent restarting to rejoin) is deleted from the state the same way, heartbeat and all, so the state
alone cannot tell a dead node from one a moment away from rejoining. The ledger remembers, across
syncs, the last heartbeat seen from each node, which nodes the clean-up dropped, and which nodes
were declared dead because their agent's connection closed (:mod:`agent.liveness`); a declared
node is dropped from the state at this node's next sync, and from everyone's once written back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from agent import torch_private

_LONG_AGO = datetime.fromtimestamp(0, timezone.utc)
"""The heartbeat a declared-dead node gets in the state: torch's clean-up drops it at once."""


class NodeLedger:
    """The liveness of every node this agent has heard of (nodes named as in the state,
    ``addr_pid_localid``). Install one per handler with :meth:`install`.

    Args:
        heartbeat_timeout: seconds without a heartbeat after which torch drops a node.
    """

    def __init__(self, heartbeat_timeout: float) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}
        """node -> its newest heartbeat seen (seconds since the epoch)"""
        self._dropped: dict[str, float] = {}
        """node -> its last heartbeat, for the nodes torch's clean-up dropped since"""
        self._declared: dict[str, float] = {}
        """node -> when its connection closed (seconds since the epoch)"""
        self._unwritten = False
        """A declared-dead node was dropped from this node's copy of the state, not yet written back."""

    @classmethod
    def install(cls, handler: DynamicRendezvousHandler) -> NodeLedger:
        """A ledger fed by every sync of ``handler``'s state (keep-alives, rendezvous, reads), which
        also drops the declared-dead nodes from the state."""
        settings = handler.settings
        ledger = cls((settings.keep_alive_interval * settings.keep_alive_max_attempt).total_seconds())
        own = torch_private.this_node(handler)

        def record_around(holder: Any, cleanup: Callable[[], None]) -> Callable[[], None]:
            def cleanup_and_record() -> None:
                state = torch_private.unsanitized_state(holder)
                ledger.saw({str(node): moment.timestamp() for node, moment in state.last_heartbeats.items()})
                for node in state.last_heartbeats:
                    if ledger.declared_dead(str(node)):
                        state.last_heartbeats[node] = _LONG_AGO
                        ledger._unwritten = True
                # This agent runs: a stall of its whole machine (a paused VM) lapses its own heartbeat
                # too, but a node is dead only by its peers' account (left to the clean-up, a job of
                # one node would drop itself and restart). Hidden from it, kept as it is (stale, so
                # that the next keep-alive writes a new one).
                mine = {node: beat for node, beat in state.last_heartbeats.items() if str(node) == own}
                for node in mine:
                    del state.last_heartbeats[node]
                torch_private.forget_dropped_nodes(holder)
                try:
                    cleanup()
                finally:
                    state.last_heartbeats.update(mine)
                ledger._record_dropped([str(node) for node in torch_private.nodes_dropped_by_cleanup(holder)])

            return cleanup_and_record

        torch_private.wrap_state_cleanup(handler, record_around)
        return ledger

    def saw(self, heartbeats: dict[str, float]) -> None:
        """Record heartbeats read from the state (node -> seconds since the epoch). A heartbeat
        newer than the one a node was dropped with brings it back (a frozen node thawed), and one
        newer than its declaration undoes that (its agent lives: its connection ended otherwise)."""
        with self._lock:
            for node, moment in heartbeats.items():
                if moment <= _LONG_AGO.timestamp():
                    continue
                if moment > self._seen.get(node, 0.0):
                    self._seen[node] = moment
                if node in self._dropped and moment > self._dropped[node]:
                    del self._dropped[node]
                if node in self._declared and moment > self._declared[node]:
                    del self._declared[node]

    def lapsed(self, nodes: dict[str, float]) -> None:
        """Record nodes whose heartbeats lapsed as the backend itself tells (etcd3's expired
        heartbeat keys: node -> its last refresh). They are dropped until a newer heartbeat."""
        with self._lock:
            for node, refreshed in nodes.items():
                self._dropped.setdefault(node, max(refreshed, self._seen.get(node, 0.0)))

    def declare_dead(self, node: str, at: float | None = None) -> None:
        """``node``'s agent process is gone (its connection closed without a goodbye)."""
        with self._lock:
            self._declared.setdefault(node, time.time() if at is None else at)

    def take_unwritten(self) -> bool:
        """Whether this node's copy of the state dropped a declared-dead node since the last call:
        then write the state back (``mark_dirty``, ``sync``) so that every node sees it gone."""
        with self._lock:
            unwritten, self._unwritten = self._unwritten, False
            return unwritten

    def declared_dead(self, node: str) -> bool:
        with self._lock:
            return node in self._declared

    def declared(self) -> dict[str, float]:
        """The nodes declared dead, with when their connection closed."""
        with self._lock:
            return dict(self._declared)

    def is_dead(self, node: str) -> bool:
        """Whether ``node`` is gone for good as far as this agent knows: declared dead, dropped by
        torch's clean-up and not heard from since, or silent for longer than the heartbeat timeout."""
        with self._lock:
            if node in self._declared or node in self._dropped:
                return True
            seen = self._seen.get(node)
            return seen is None or time.time() - seen >= self.heartbeat_timeout

    def last_heartbeat(self, node: str) -> float | None:
        """The newest heartbeat seen from ``node`` (seconds since the epoch), if any."""
        with self._lock:
            return self._seen.get(node)

    def _record_dropped(self, nodes: list[str]) -> None:
        with self._lock:
            for node in nodes:
                self._dropped[node] = self._seen.get(node, 0.0)
