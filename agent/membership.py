"""Watches the rendezvous state of the agent's round: lost and hung nodes, joining nodes, and this
node's own eviction (a node thawed after the others declared it dead).

It reads the state torch.distributed.elastic's ``DynamicRendezvousHandler`` keeps in its backend
(c10d store, etcd3): the round, its participants, the wait list and each node's last heartbeat.
Syncing that state also runs torch's own clean-up, which drops nodes whose heartbeats lapsed
(``keep_alive_interval`` x ``keep_alive_max_attempt``); a participant of our round that is gone
from the state is lost.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
)

Cause = Literal["node_lost", "node_hung", "node_joined", "worker_failed"]
"""node_lost: a participant's heartbeats lapsed (killed, frozen or cut off: from the survivors'
side these look alike); node_hung: this node finds itself out of the round it was running, so it
was the unresponsive one (frozen, then thawed); node_joined: nodes wait to join (new nodes, or peers
that left the round by themselves to rejoin); worker_failed: a local worker failed while membership
held."""


@dataclass(frozen=True)
class Membership:
    """The rendezvous state as one agent sees it."""

    round: int
    complete: bool
    participants: frozenset[str]
    waiting: frozenset[str]
    last_heartbeats: dict[str, float]
    """node -> wall-clock time of its last heartbeat (seconds since the epoch)"""


@dataclass(frozen=True)
class Change:
    """A membership change seen by the watch."""

    cause: Cause
    lost: frozenset[str] = frozenset()
    joined: frozenset[str] = frozenset()
    failed_at: float | None = None
    """Best estimate of when the failure happened: the lost nodes' last heartbeat."""
    workers_blocked: bool = False
    """The local workers were still running, blocked on the lost peer, when the loss was seen."""


class MembershipWatch:
    """Compares the rendezvous state with the round this agent's workers run in. With a backend
    that can watch its state (etcd3), every change of the state is checked as soon as it lands.

    Args:
        handler: the agent's rendezvous handler (a DynamicRendezvousHandler: c10d, etcd3).
        poll_interval: the least time between two reads of the state.
    """

    def __init__(self, handler: DynamicRendezvousHandler, *, poll_interval: float) -> None:
        self._handler = handler
        self._poll_interval = poll_interval
        self._round: Membership | None = None
        self._last_poll = 0.0
        self._heartbeats: dict[str, float] = {}
        self._changed = threading.Event()
        settings = handler.settings
        self.heartbeat_timeout = (settings.keep_alive_interval * settings.keep_alive_max_attempt).total_seconds()
        """Seconds without a heartbeat after which torch drops a node."""
        backend = getattr(handler._state_holder, "_backend", None)
        if hasattr(backend, "watch_state"):  # etcd3: be told of every change instead of polling
            backend.watch_state(self._changed.set)

    @property
    def node(self) -> str:
        return str(self._handler._this_node)

    def read(self) -> Membership:
        """Sync with the backend and return the current state."""
        handler = self._handler
        with handler._heartbeat_lock:
            handler._state_holder.sync()
            state = handler._state_holder.state
            heartbeats = {str(n): _epoch(t) for n, t in state.last_heartbeats.items()}
            membership = Membership(
                round=state.round,
                complete=state.complete,
                participants=frozenset(str(n) for n in state.participants),
                waiting=frozenset(str(n) for n in state.wait_list),
                last_heartbeats=heartbeats,
            )
        self._heartbeats.update(heartbeats)
        return membership

    def start_round(self) -> Membership:
        """Remember the round just completed (call after each rendezvous)."""
        self._round = self.read()
        return self._round

    def check(self, *, workers_healthy: bool, now: bool = False) -> Change | None:
        """The change since ``start_round``, if any. Reads the state at most every poll_interval,
        unless ``now`` (workers just failed: was it because of a membership change?)."""
        clock = time.monotonic()
        due = now or self._changed.is_set() or clock - self._last_poll >= self._poll_interval
        if self._round is None or not due:
            return None
        self._last_poll = clock
        self._changed.clear()
        current = self.read()
        if current.round != self._round.round or self.node not in current.participants:
            return Change("node_hung", lost=frozenset({self.node}))
        gone = self._round.participants - current.participants
        lost = frozenset(node for node in gone if not self._heard_from_lately(node))
        if lost:
            return Change("node_lost", lost=lost, failed_at=self.last_heartbeat(lost), workers_blocked=workers_healthy)
        # A participant that left with a current heartbeat left by itself: its agent is restarting
        # (for a joining node, or a failed worker of its own) and rejoins through the wait list.
        if current.waiting or gone:
            return Change("node_joined", joined=current.waiting | gone)
        return None

    def _heard_from_lately(self, node: str) -> bool:
        """Whether ``node``'s last heartbeat seen is younger than the heartbeat timeout: torch
        drops a node only after its heartbeats lapsed that long."""
        seen = self._heartbeats.get(node)
        return seen is not None and time.time() - seen < self.heartbeat_timeout

    def last_heartbeat(self, nodes: frozenset[str]) -> float | None:
        """The latest heartbeat seen from any of ``nodes`` (when they stopped), if any was seen."""
        seen = [self._heartbeats[n] for n in nodes if n in self._heartbeats]
        return max(seen) if seen else None


def _epoch(moment: datetime) -> float:
    return moment.timestamp()
