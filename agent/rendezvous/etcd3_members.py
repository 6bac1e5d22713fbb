"""The etcd3 rendezvous with heartbeats as leased keys: what a keep-alive costs stays the same
however many nodes there are.

torch's dynamic rendezvous keeps every node's heartbeat inside its one shared state, and every node
rewrites that state (compare-and-set) every keep-alive interval; each write is sent to every
node's watch: the bytes grow with the square of the node count. Here, under
``<prefix>/<run_id>/members/``:

* ``round`` holds the state without heartbeats; it is written only when the round changes (a node
  joins, leaves or is found dead, a round completes), by compare-and-set on its mod_revision,
  which stays torch's fencing token;
* ``node/<name>`` is each node's heartbeat: a key on a lease of the node's own whose time to live
  is the heartbeat timeout (keep_alive_interval x keep_alive_max_attempt). torch's keep-alive
  refreshes the lease and writes nothing; when the node dies its lease expires and etcd deletes
  the key;
* each node mirrors the prefix through one watch: reads of the state are served from the mirror,
  and the prefix changes only when membership does.

To torch's handler the state looks as ever: the backend gives every listed node a heartbeat, the
time of this node's last refresh for itself, now for a node whose key lives, and for a node whose
key expired the estimate of its last refresh (one time to live before etcd deleted it), which
torch's clean-up then drops as dead; a listed node whose key this node has not seen (the watch
lags its creation, or it vanished before this node watched) is given the time it was first found
missing, so it lapses one heartbeat timeout later unless its key shows up. After a lost
compare-and-set the backend waits a random, growing time before torch retries: rounds are still
written one node at a time, and every node changes the round at once after a loss.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from agent.rendezvous import etcd3_client, round_state

if TYPE_CHECKING:
    from agent.torch_private import RendezvousState
    from agent.rendezvous.etcd3_backend import Etcd3Lease
    from agent.rendezvous.etcd3_client import Etcd3Connection

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.005
MAX_BACKOFF_S = 1.0
"""The range of the random wait after the first lost compare-and-set, and its cap."""
REUSE_S = 0.5
"""How long an unchanged state is given again as it was made: a live node's heartbeat in it is
then at most this old, well within any heartbeat timeout."""
CATCH_UP_S = 1.0
"""How long a read waits for the watch to start before it reads etcd directly."""
MAX_DELETES = 100
"""Heartbeat keys one write deletes at most: etcd refuses a transaction of more than 128
operations by default (``--max-txn-ops``); keys left over expire with their leases."""


@dataclass(frozen=True)
class MembersView:
    """The members prefix at one revision."""

    round: bytes | None
    revision: int
    """The round key's mod_revision (0 when there is no round yet): torch's fencing token."""
    live: frozenset[str]
    """Nodes whose heartbeat key exists."""
    lapsed: dict[str, float] = field(default_factory=dict)
    """Nodes whose heartbeat key expired -> the estimate of their last refresh (epoch seconds)."""


class MembersMirror:
    """The members prefix as one watch delivers it; falls back to reading etcd while the watch is
    not established (at start, during an outage) or lags."""

    def __init__(self, connection: Etcd3Connection, prefix: str, ttl_s: float) -> None:
        self._connection = connection
        self.round_key = prefix + "round"
        self.node_prefix = prefix + "node/"
        self._prefix = prefix
        self._ttl_s = ttl_s
        self._delete_event = etcd3_client.import_etcd3().events.DeleteEvent
        self._changed = threading.Condition()
        """Guards the fields below; notified when the watch applied a change."""
        self._round: bytes | None = None
        self._round_revision = 0
        self._round_writes: deque[int] = deque(maxlen=1024)
        """Recent revisions that wrote the round: a node key deleted in one was let go, not lapsed."""
        self._nodes: set[str] = set()
        self._lapsed: dict[str, float] = {}
        self._revision = 0
        """The store revision the mirror reflects."""
        self._synced = False
        self._callbacks: list[Callable[[], None]] = []
        self._started = False
        self._closed = threading.Event()
        self._cancel: Callable[[], None] | None = None
        """Ends the watch under way, if one is."""

    def close(self) -> None:
        """Stop following the prefix: the watch is cancelled and its thread ends (reads go to etcd).
        Never blocks: etcd3's cancel can wait forever on a watch stream that an outage broke, so it
        runs in a thread of its own (its first act ends the iteration the follower is in)."""
        self._closed.set()
        with self._changed:
            cancel, self._synced = self._cancel, False
        if cancel is not None:
            threading.Thread(target=cancel, name="torchrevive-etcd3-watch-cancel", daemon=True).start()

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the watch's thread) after every change the watch applies."""
        with self._changed:
            self._callbacks.append(callback)
        self._start()

    def view(self) -> MembersView:
        """The prefix: from the mirror while the watch runs (waiting up to CATCH_UP_S for it to
        start), else read from etcd."""
        self._start()
        with self._changed:
            if self._changed.wait_for(lambda: self._synced, timeout=CATCH_UP_S):
                return self._snapshot()
        self._load(self._read())
        with self._changed:
            return self._snapshot()

    def note_round(self, value: bytes | None, revision: int) -> None:
        """The round as a transaction of this node found or wrote it, ahead of the watch."""
        with self._changed:
            if value is not None and revision > self._round_revision:
                self._round, self._round_revision = value, revision
                self._round_writes.append(revision)

    def _snapshot(self) -> MembersView:
        return MembersView(self._round, self._round_revision, frozenset(self._nodes), dict(self._lapsed))

    def _start(self) -> None:
        with self._changed:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._follow_forever, name="torchrevive-etcd3-members", daemon=True).start()

    def _read(self) -> Any:
        return self._connection.call(lambda c: c.get_prefix_response(self._prefix))

    def _load(self, response: Any) -> None:
        """Replace the mirror by a range read (kept only when newer than what it holds)."""
        revision = response.header.revision
        with self._changed:
            if revision < self._revision:
                return
            nodes, round_value, round_revision = set(), None, 0
            for kv in response.kvs:
                key = kv.key.decode()
                if key == self.round_key:
                    round_value, round_revision = kv.value, kv.mod_revision
                elif key.startswith(self.node_prefix):
                    nodes.add(key[len(self.node_prefix):])
            for name in self._nodes - nodes:  # gone while unwatched: a lapse, unless the round let it go
                self._lapsed.setdefault(name, time.time() - self._ttl_s)
            self._round, self._round_revision, self._nodes, self._revision = round_value, round_revision, nodes, revision

    def _follow_forever(self) -> None:
        while not self._closed.is_set():
            try:
                self._connection.call(self._follow)
            except RendezvousError:  # etcd unreachable for read_timeout: keep trying; reads go to etcd meanwhile
                logger.debug("the etcd watch on %s ended; re-establishing", self._prefix, exc_info=True)
            except Exception:  # a background thread: whatever broke the watch, reads go to etcd until it is back
                logger.warning("the etcd watch on %s failed; re-establishing", self._prefix, exc_info=True)
            with self._changed:
                self._synced = False
            self._closed.wait(0.5)

    def _follow(self, client: Any) -> None:
        """Load the prefix, then apply every change from the next revision on (until the watch breaks)."""
        self._load(client.get_prefix_response(self._prefix))
        with self._changed:
            start = self._revision + 1
        responses, cancel = client.watch_prefix_response(self._prefix, start_revision=start)
        with self._changed:
            self._synced, self._cancel = True, cancel
            self._changed.notify_all()
        try:
            if self._closed.is_set():
                return  # closed while the watch started
            for response in responses:
                self._apply(response.events)
        finally:
            with self._changed:
                self._synced, self._cancel = False, None
            if not self._closed.is_set():  # closed: close() cancels it
                cancel()

    def _apply(self, events: Any) -> None:
        """Apply one watch response's events (etcd3's PutEvent and DeleteEvent)."""
        with self._changed:
            for event in events:
                if event.mod_revision <= self._revision:
                    continue  # already in a range read loaded meanwhile
                key, deleted = event.key.decode(), isinstance(event, self._delete_event)
                if key == self.round_key:
                    self._round_writes.append(event.mod_revision)
                    if deleted:
                        self._round, self._round_revision = None, 0
                    elif event.mod_revision > self._round_revision:
                        self._round, self._round_revision = event.value, event.mod_revision
                elif key.startswith(self.node_prefix):
                    self._apply_node(key[len(self.node_prefix):], event.mod_revision, deleted=deleted)
            if events:
                self._revision = max(self._revision, events[-1].mod_revision)
            callbacks = list(self._callbacks)
            self._changed.notify_all()
        for callback in callbacks:
            callback()

    def _apply_node(self, name: str, revision: int, *, deleted: bool) -> None:
        if not deleted:
            self._nodes.add(name)
            self._lapsed.pop(name, None)
            return
        self._nodes.discard(name)
        # Deleted by the transaction that wrote the round (the round's put comes first in it): the
        # node left or was let go. Deleted alone: its lease expired, one time to live after its
        # last refresh.
        if revision not in self._round_writes:
            self._lapsed[name] = time.time() - self._ttl_s


class HeartbeatLease:
    """This node's heartbeat lease: granted when its key is written, refreshed by each keep-alive."""

    def __init__(self, connection: Etcd3Connection, ttl_s: int) -> None:
        self._connection = connection
        self._ttl_s = ttl_s
        self._lease: Any = None

    def get(self) -> Any:
        if self._lease is None:
            self._lease = self._connection.call(lambda c: c.lease(self._ttl_s))
        return self._lease

    def forget(self) -> None:
        """Drop the lease (it expired); the next write gets a new one."""
        self._lease = None

    def refresh(self) -> bool:
        """Send one keep-alive; False when the lease had expired (the node's key is gone with it)."""
        if self._lease is None:
            return False
        lease_id = self._lease.id
        answers = self._connection.call(lambda c: list(c.refresh_lease(lease_id)))
        if not answers or answers[0].TTL <= 0:
            self._lease = None
            return False
        return True


class Etcd3MembersBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` as a round key written on membership changes and a leased
    heartbeat key per node (see the module's docstring). Call :meth:`bind_node` with the handler's
    node before the first write."""

    def __init__(self, connection: Etcd3Connection, run_id: str, *, prefix: str, lease: Etcd3Lease,
                 heartbeat_timeout_s: int) -> None:
        if not run_id:
            raise ValueError("the etcd3 rendezvous needs a run id (--rdzv-id / job.id)")
        self._connection = connection
        self._cleanup_lease = lease
        self._mirror = MembersMirror(connection, f"{prefix}/{run_id}/members/", heartbeat_timeout_s)
        self._heartbeat = HeartbeatLease(connection, heartbeat_timeout_s)
        self._node: str | None = None
        self._refreshed: datetime | None = None
        """When this node's heartbeat lease was last granted or refreshed."""
        self._lock = threading.Lock()
        """One operation at a time (torch's keep-alive timer and the membership watch share the backend)."""
        self._decoded: tuple[int, RendezvousState | None] = (-1, None)
        self._losses = 0
        """Compare-and-sets lost in a row."""
        self._encoded: tuple[bytes, Any, float] = (b"", None, 0.0)
        """The last state given to torch, what it was made from, and when (monotonic)."""
        self._missing_since: dict[str, datetime] = {}
        """Listed nodes with no heartbeat key, neither live nor seen lapsing -> since when."""

    @property
    def name(self) -> str:
        return "etcd3"

    @property
    def key(self) -> str:
        """The etcd key the round is kept under."""
        return self._mirror.round_key

    def close(self) -> None:
        """Stop mirroring the members (the agent is done)."""
        self._mirror.close()

    def bind_node(self, node: str) -> None:
        """The handler's own node (torch's ``addr_pid_localid``)."""
        self._node = node

    def watch_state(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from a background thread) whenever the round or a heartbeat key changes."""
        self._mirror.on_change(callback)

    def lapsed(self) -> dict[str, float]:
        """The nodes whose heartbeat key expired -> when each last refreshed it (epoch seconds); a
        node that left by itself is not among them."""
        return self._mirror.view().lapsed

    def get_state(self) -> tuple[bytes, Token] | None:
        with self._lock:
            return self._state_of(self._mirror.view())

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        assert self._node is not None, "bind_node before the first write"
        with self._lock:
            view = self._mirror.view()
            if token is not None and not isinstance(token, int):  # not one of ours: torch expects a refusal
                current = self._state_of(view)
                return None if current is None else (*current, False)
            wanted, heartbeats = round_state.split(round_state.decode(state))
            beat = heartbeats.get(self._node)
            stored = self._round_of(view)
            changed = stored is None or token != view.revision or not round_state.same_round(wanted, stored)
            create = beat is not None and self._node not in view.live
            # Keys the round let go, judged only against the round as it stands (a stale state
            # lacks every node that joined since; its compare-and-set fails anyway).
            deletes = sorted(view.live - heartbeats.keys())[:MAX_DELETES] if token == view.revision else []
            succeeded = True
            if changed or create or deletes:
                succeeded, found, revision = self._write(wanted if changed else None, token, create=create,
                                                         deletes=deletes)
                if succeeded and create:
                    self._refreshed = datetime.now(timezone.utc)
                self._back_off(succeeded)
                self._mirror.note_round(found, revision)
                view = self._mirror.view()
            if succeeded and beat is not None and not create and (self._refreshed is None or beat > self._refreshed):
                if self._heartbeat.refresh():
                    self._refreshed = datetime.now(timezone.utc)
            current = self._state_of(view)
            return None if current is None else (*current, succeeded)

    def _back_off(self, succeeded: bool) -> None:
        """After a lost compare-and-set, wait a random time, doubling its range with each loss in a
        row: torch retries at once, and when many nodes change the round together (everyone
        rejoins after a loss) the retries would keep colliding."""
        self._losses = 0 if succeeded else self._losses + 1
        if self._losses:
            time.sleep(random.uniform(0, min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self._losses - 1))))

    def _write(self, wanted: RendezvousState | None, token: Token | None, *, create: bool,
               deletes: list[str]) -> tuple[bool, bytes | None, int]:
        """One transaction, if the round's revision is still ``token``: the round (when given), this
        node's heartbeat key, the deletion of keys the round let go. Returns whether it was done,
        and the round found after it and its revision."""
        round_key = self._mirror.round_key
        value = None if wanted is None else round_state.encode(wanted)
        lease = self._cleanup_lease.get() if value is not None else None
        heartbeat = self._heartbeat.get() if create else None

        def transaction(client: Any) -> tuple[bool, list]:
            txn = client.transactions
            compare = [txn.version(round_key) == 0] if token is None else [txn.mod(round_key) == int(token)]
            success = [txn.put(round_key, value, lease)] if value is not None else []  # first: see MembersMirror._apply_node
            if heartbeat is not None:
                success.append(txn.put(self._mirror.node_prefix + str(self._node), b"", heartbeat))
            success += [txn.delete(self._mirror.node_prefix + name) for name in deletes]
            return client.transaction(compare=compare, success=[*success, txn.get(round_key)],
                                      failure=[txn.get(round_key)])

        try:
            succeeded, responses = self._connection.call(transaction)
        except Exception as exc:
            if not _lease_not_found(exc):
                raise
            if not create:
                raise
            # The heartbeat lease expired since it was granted (the node was frozen, or starved of
            # CPU, for a time to live): its key is written on a new one.
            self._heartbeat.forget()
            heartbeat = self._heartbeat.get()
            succeeded, responses = self._connection.call(transaction)
        found = responses[-1]
        return (succeeded, found[0][0], found[0][1].mod_revision) if found else (succeeded, None, 0)

    def _round_of(self, view: MembersView) -> RendezvousState | None:
        """The view's round, decoded once per revision (callers hold the lock and do not change it)."""
        if view.round is None:
            return None
        if self._decoded[0] != view.revision:
            self._decoded = (view.revision, round_state.decode(view.round, f"the etcd key {self.key}"))
        return self._decoded[1]

    def _state_of(self, view: MembersView) -> tuple[bytes, Token] | None:
        """torch's state: the view's round, a heartbeat for every listed node (the same bytes again
        for up to REUSE_S while nothing changed: a waiting node reads ten times a second)."""
        state = self._round_of(view)
        if state is None:
            return None
        key = (view.revision, view.live, frozenset(view.lapsed.items()), self._refreshed)
        encoded, key_then, made = self._encoded
        if key == key_then and time.monotonic() - made < REUSE_S:
            return encoded, view.revision
        now = datetime.now(timezone.utc)
        heartbeats = {}
        for node in round_state.listed(state):
            name = round_state.node_name(node)
            if name == self._node and name in view.live:
                heartbeats[node] = self._refreshed or now
            elif name in view.live:
                heartbeats[node] = now
            elif name in view.lapsed:
                heartbeats[node] = datetime.fromtimestamp(view.lapsed[name], timezone.utc)
            else:  # not seen yet (the watch lags its write), or gone before this node watched
                heartbeats[node] = self._missing_since.setdefault(name, now)
        for name in view.live & self._missing_since.keys():
            del self._missing_since[name]
        state.last_heartbeats = heartbeats
        try:
            encoded = round_state.encode(state)
        finally:
            state.last_heartbeats = {}
        if not self._missing_since:  # a missing node's heartbeat ages: made anew each time
            self._encoded = (encoded, key, time.monotonic())
        return encoded, view.revision


def _lease_not_found(exc: BaseException) -> bool:
    """etcd's refusal of a write on a lease that expired."""
    details = getattr(exc, "details", None)
    return callable(details) and "lease not found" in (details() or "")
