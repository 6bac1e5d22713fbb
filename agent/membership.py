"""Watches the rendezvous state of the agent's round: lost and hung nodes, joining nodes, and this
node's own eviction (a node thawed after the others declared it dead).

It reads the state torch.distributed.elastic's ``DynamicRendezvousHandler`` keeps in its backend
(c10d store, etcd3): the round, its participants, the wait list and each node's last heartbeat.
Syncing that state also runs torch's own clean-up, which drops nodes whose heartbeats lapsed
(``keep_alive_interval`` x ``keep_alive_max_attempt``); a participant of our round that is gone
from the state is lost. A participant whose agent's connection closed (:mod:`agent.liveness`) is
lost at once, without waiting for its heartbeats to lapse.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
)

from agent import torch_private
from agent.rendezvous.node_ledger import NodeLedger

logger = logging.getLogger(__name__)

FRESH_READ_WAIT_S = 1.0
"""How long ``check(now=True)`` waits for a fresh read; the backend answers in milliseconds when it
is reachable, and the monitor loop must not wait out an outage."""

Cause = Literal["node_lost", "node_hung", "node_joined", "round_advanced", "worker_failed"]
"""node_lost: a participant's heartbeats lapsed (killed, frozen or cut off: from the survivors'
side these look alike), or a peer moved the round on without it or dropped it from the round as
dead; node_hung: this node finds itself out of the round it was running, so it was the
unresponsive one (frozen, then thawed); node_joined:
nodes wait to join (new nodes, or peers that left the round by themselves to rejoin);
round_advanced: a peer moved the round on (for a change it saw first, or a failed worker of its
own) and carried this node into it, losing nobody; worker_failed: a local worker failed while
membership held."""


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
    by_connection: bool = False
    """The loss was seen from the lost agent's closed connection, not from its heartbeats."""
    left: frozenset[str] = frozenset()
    """Participants that left the round by themselves (their agents restart): their workers are
    gone, so the local ones cannot train on."""

    @property
    def only_joins(self) -> bool:
        """Nodes wait to join, and every participant is still in the round: the workers can train on."""
        return self.cause == "node_joined" and not self.lost and not self.left

    @property
    def loses_nobody(self) -> bool:
        """Every participant of this node's round is in the next one: nodes join, seen directly or
        from a peer that moved the round on for them (the step in flight can finish)."""
        return self.only_joins or (self.cause == "round_advanced" and bool(self.joined))


class MembershipWatch:
    """Compares the rendezvous state with the round this agent's workers run in.

    The state is read by a background thread every ``poll_interval`` and, with a backend that can
    watch its state (etcd3), as soon as a change lands; with etcd3's heartbeat keys, where every
    change (a lapse too) lands so, on those wake-ups and otherwise only every half heartbeat
    timeout. The monitor loop only compares the latest
    read with its round, so it never waits on the backend: while the store or etcd is unreachable,
    for however long, the reads fail (logged once per outage) and the workers keep training. Reads
    pause during a rendezvous, which uses the handler's state alone.

    Args:
        handler: the agent's rendezvous handler (a DynamicRendezvousHandler: c10d, etcd3).
        ledger: the liveness of the nodes, fed by every sync of the handler's state.
        poll_interval: the least time between two reads of the state.
    """

    def __init__(self, handler: DynamicRendezvousHandler, *, ledger: NodeLedger, poll_interval: float) -> None:
        self._handler = handler
        self._ledger = ledger
        self._poll_interval = poll_interval
        self._round: Membership | None = None
        self._round_started = 0.0
        self._reported_dead: frozenset[str] = frozenset()
        self._wake = threading.Event()
        self._running = threading.Event()
        """Set while a round runs: the reader reads only then."""
        self._reading = threading.Lock()
        """Held through one read (retries included); :meth:`pause` waits for it."""
        self._published = threading.Condition()
        self._latest: tuple[float, Membership] | None = None
        """When the latest successful read started (monotonic), and what it found."""
        self._compared = 0.0
        self._closed = False
        self.unreachable_since: float | None = None
        """When reads began to fail (monotonic), while they do."""
        self.heartbeat_timeout = ledger.heartbeat_timeout
        """Seconds without a heartbeat after which torch drops a node."""
        backend = torch_private.state_backend(handler)
        if hasattr(backend, "watch_state"):  # etcd3: be told of every change instead of polling
            backend.watch_state(self._wake.set)
        self._lapsed: Callable[[], dict[str, float]] | None = getattr(backend, "lapsed", None)
        """etcd3's heartbeat keys: the nodes whose key expired, and when each last refreshed it."""
        self._idle_wait = poll_interval if self._lapsed is None else max(poll_interval, self.heartbeat_timeout / 2)
        """How long the reader waits for a wake-up before it reads anyway. With etcd3's heartbeat
        keys every change (a lapse too: etcd deletes the expired key) wakes it, and nothing changes
        while membership holds: a read now and then only ages a node whose key was never seen."""
        threading.Thread(target=self._read_loop, name="torchrevive-membership", daemon=True).start()

    @property
    def poll_interval(self) -> float:
        """The least time between two reads of the state."""
        return self._poll_interval

    @property
    def node(self) -> str:
        return torch_private.this_node(self._handler)

    def read(self) -> Membership:
        """Sync with the backend and return the current state (blocks while the backend retries)."""
        with torch_private.synced_state(self._handler) as holder:
            if self._ledger.take_unwritten():  # drop the declared-dead nodes for every node
                holder.mark_dirty()
                holder.sync()
            state = holder.state
            heartbeats = {str(n): t.timestamp() for n, t in state.last_heartbeats.items()}
            membership = Membership(
                round=state.round,
                complete=state.complete,
                participants=frozenset(str(n) for n in state.participants),
                waiting=frozenset(str(n) for n in state.wait_list),
                last_heartbeats=heartbeats,
            )
        if self._lapsed is not None:  # the state shows a live node's heartbeat as now, a lapsed one's gone
            self._ledger.lapsed(self._lapsed())
        return membership

    def declare_dead(self, node: str, at: float) -> None:
        """``node``'s agent is gone (its connection closed at ``at``): report it as lost at the next
        check, and drop it from the rendezvous state at the next read."""
        self._ledger.declare_dead(node, at)
        self._wake.set()

    def pause(self) -> None:
        """Stop reading (call before each rendezvous); returns once no read is in flight."""
        self._running.clear()
        with self._reading:
            pass

    def start_round(self, completed_round: int | None = None) -> Membership:
        """Remember the round just completed and resume reading (call after each rendezvous).

        ``completed_round``: the round this node's rendezvous completed in, where known. A peer may
        have moved the round on since, carrying this node along: its workers still run the round
        completed, and the first check reports the one after it."""
        self.pause()
        self._round_started = time.monotonic()
        self._reported_dead = frozenset()
        current = self.read()
        if completed_round is not None and current.round > completed_round:
            current = replace(current, round=completed_round)
        self._round = current
        self._running.set()
        return self._round

    def close(self) -> None:
        """End the background reader; returns once no read is in flight (a thread left inside a
        store call when the process exits aborts it)."""
        self._closed = True
        self.pause()
        self._running.set()
        self._wake.set()

    def check(self, *, workers_healthy: bool, now: bool = False) -> Change | None:
        """The change since ``start_round`` that the latest read shows, if any (each read is
        compared once), or a participant declared dead since (told once). With ``now`` (workers
        just failed: was it because of a membership change?) it waits up to FRESH_READ_WAIT_S for
        a read that starts after the call."""
        if self._round is None:
            return None
        declared = {node: at for node, at in self._ledger.declared().items()
                    if node in self._round.participants and node not in self._reported_dead}
        if declared:
            self._reported_dead |= declared.keys()
            return Change("node_lost", lost=frozenset(declared), failed_at=min(declared.values()),
                          workers_blocked=workers_healthy, by_connection=True)
        asked = time.monotonic()
        if now:
            self._wake.set()
        with self._published:
            if now:
                self._published.wait_for(lambda: self._latest is not None and self._latest[0] >= asked,
                                         timeout=FRESH_READ_WAIT_S)
            latest = self._latest
        if latest is None or latest[0] < self._round_started or latest[0] <= self._compared:
            return None
        self._compared = latest[0]
        return self._change(latest[1], workers_healthy)

    def _change(self, current: Membership, workers_healthy: bool) -> Change | None:
        assert self._round is not None, "compared only once a round started"
        if current.round < self._round.round or self.node not in current.participants:
            return Change("node_hung", lost=frozenset({self.node}))
        gone = self._round.participants - current.participants
        if current.round > self._round.round:  # a peer moved the round on, leaving only dead nodes behind
            if gone:
                return Change("node_lost", lost=gone, failed_at=self.last_heartbeat(gone), workers_blocked=workers_healthy)
            return Change("round_advanced", joined=current.participants - self._round.participants)
        # A participant gone from the round with a current heartbeat here either left by itself,
        # torch's way, and waits to rejoin (a prompt executor moves the round on instead, unless the
        # round it leaves never completed), or was dropped by a peer that saw it die first (its
        # connection closed there): this node's own connection to it may not have told it yet.
        lost = frozenset(node for node in gone if self._ledger.is_dead(node) or node not in current.waiting)
        if lost:
            return Change("node_lost", lost=lost, failed_at=self.last_heartbeat(lost), workers_blocked=workers_healthy)
        if current.waiting or gone:
            return Change("node_joined", joined=current.waiting | gone, left=gone)
        return None

    def _read_loop(self) -> None:
        while True:
            self._wake.wait(self._idle_wait)
            self._wake.clear()
            self._running.wait()
            if self._closed:
                return
            with self._reading:
                if not self._running.is_set():
                    continue
                started = time.monotonic()
                membership = self._read_through_outages()
            if membership is not None:
                with self._published:
                    self._latest = (started, membership)
                    self._published.notify_all()

    def _read_through_outages(self) -> Membership | None:
        """A read, or None while the backend is unreachable (logged when an outage starts and ends)."""
        try:
            membership = self.read()
        except Exception as exc:  # the reader outlives any backend failure; the next poll tries again
            if self.unreachable_since is None:
                self.unreachable_since = time.monotonic()
                logger.warning("the rendezvous state is unreachable (%s: %s); the workers keep training, and the "
                               "agent keeps trying every %.2f s", type(exc).__name__, exc, self._idle_wait)
            return None
        if self.unreachable_since is not None:
            logger.warning("the rendezvous state is reachable again after %.1f s",
                           time.monotonic() - self.unreachable_since)
            self.unreachable_since = None
        return membership

    def last_heartbeat(self, nodes: frozenset[str]) -> float | None:
        """The latest heartbeat seen from any of ``nodes`` (when they stopped), if any was seen."""
        seen = [t for t in map(self._ledger.last_heartbeat, nodes) if t is not None]
        return max(seen) if seen else None
