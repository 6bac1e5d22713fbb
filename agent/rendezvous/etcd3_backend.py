"""The ``etcd3`` rendezvous backend: torch.distributed.elastic's dynamic rendezvous over the etcd v3
API, so that no agent is a single point of failure (the c10d backend's store lives in one agent)
and etcd 3.6, which dropped the v2 API that torch's own etcd backends speak, works.

* By default (``heartbeats=keys``) the round is one key and each node's heartbeat a leased key of
  its own (:mod:`agent.rendezvous.etcd3_members`); with ``heartbeats=state``, torch's layout, the
  whole state is one key, ``<prefix>/<run_id>/state``. Either way ``set_state`` is a transaction
  on the round's mod_revision (the fencing token), so of two writers exactly one wins.
* Keys are attached to a lease that the agent keeps alive: when every agent of a run is gone, the
  run's keys expire after ``lease_ttl`` seconds.
* ``Etcd3Store`` gives the round's key-value needs (torch's RendezvousInfo) on the same etcd.
* ``watch_state`` calls back on every change of the state key, so the membership watch reacts to
  a lapsed heartbeat or a joining node as soon as it lands instead of polling.

Registered as ``etcd3`` and ``etcd-v3`` (see :func:`register` and the ``torchrun.handlers`` entry
point in pyproject.toml). Options (``--rdzv-conf`` / ``rendezvous.conf``): ``read_timeout``,
``protocol`` (``https`` goes with ``ca_cert``), ``ca_cert``, ``ssl_cert``, ``ssl_cert_key``
(torch's etcd backend's names), ``user``,
``password_file`` (or ``password``, or TORCHREVIVE_ETCD_PASSWORD), ``key_prefix``, ``lease_ttl``,
``heartbeats``, plus the dynamic rendezvous' own timeouts.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousError, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    create_handler,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

# The module, not its names: torch loads this backend (an entry point) while it imports its own
# rendezvous package, which etcd3_client imports, so etcd3_client may be half-imported here.
from agent import torch_private
from agent.rendezvous import etcd3_client
from agent.rendezvous.checked_backend import CheckedBackend
from agent.rendezvous.etcd3_members import MAX_DELETES, Etcd3MembersBackend
from agent.timeouts import (
    TORCH_KEEP_ALIVE_MAX_ATTEMPT,
    TORCH_RENDEZVOUS_DEFAULTS_S,
    default_lease_ttl_s,
    etcd_outage_grace_s,
)

if TYPE_CHECKING:
    from agent.rendezvous.etcd3_client import Etcd3Connection, Etcd3Options

logger = logging.getLogger(__name__)

NAMES = ("etcd3", "etcd-v3")
DEFAULT_PREFIX = "/torchrevive/rendezvous"
DEFAULT_PORT = 2379
HEARTBEAT_LAYOUTS = ("keys", "state")
PASSWORD_ENV = "TORCHREVIVE_ETCD_PASSWORD"
"""The etcd password, when rendezvous.conf names a user but no password_file."""


class Etcd3Lease:
    """This agent's lease, created on first use and refreshed in the background until :meth:`close`."""

    def __init__(self, connection: Etcd3Connection, ttl: int) -> None:
        self._connection = connection
        self._ttl = ttl
        self._lease: Any = None
        self._lock = threading.Lock()
        """Guards _lease and _refresher; never held while etcd is called (its retries last up to read_timeout)."""
        self._refresher: threading.Thread | None = None
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop refreshing (the lease then expires within its TTL, and the keys on it with it: the
        agent is done). Waits for the refresher to end unless it is mid-call (it ends after)."""
        self._closed.set()
        with self._lock:
            refresher = self._refresher
        if refresher is not None:
            refresher.join(timeout=1.0)

    def get(self) -> Any:
        with self._lock:
            if self._lease is not None:
                return self._lease
        lease = self._connection.call(lambda c: c.lease(self._ttl))
        with self._lock:
            if self._lease is None:  # else another thread's grant won: this one goes unused and expires
                self._lease = lease
            if self._refresher is None:
                self._refresher = threading.Thread(target=self._refresh, name="torchrevive-etcd3-lease", daemon=True)
                self._refresher.start()
            return self._lease

    def _refresh(self) -> None:
        """Keep the lease alive until :meth:`close`, or until it has certainly expired (etcd said so, or
        no keep-alive got through for a whole TTL): then forget it and end; the next :meth:`get`
        grants a new lease and starts a new refresher."""
        kept_alive_at = time.monotonic()
        while not self._closed.wait(self._ttl / 3):
            with self._lock:
                lease = self._lease
            try:
                # etcd3's refresh_lease is a generator: the keep-alive is sent as it is consumed.
                remaining = self._connection.call(lambda c: list(c.refresh_lease(lease.id)))
                expired = not remaining or remaining[0].TTL <= 0
                kept_alive_at = time.monotonic()
            except RendezvousError:  # a background thread: log, and try again next period unless expired
                expired = time.monotonic() - kept_alive_at > self._ttl
                logger.warning("refreshing the etcd lease failed; %s", "it has expired: the next write takes a new "
                               "one" if expired else "retrying", exc_info=True)
            if expired:
                with self._lock:
                    self._lease = None
                    self._refresher = None
                return


class Etcd3RendezvousBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` on one etcd v3 key, compare-and-set on its mod_revision."""

    def __init__(self, connection: Etcd3Connection, run_id: str, *, prefix: str, lease: Etcd3Lease) -> None:
        if not run_id:
            raise ValueError("the etcd3 rendezvous needs a run id (--rdzv-id / job.id)")
        self._connection = connection
        self._key = f"{prefix}/{run_id}/state"
        self._lease = lease

    @property
    def name(self) -> str:
        return "etcd3"

    @property
    def key(self) -> str:
        """The etcd key the state is kept under."""
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        value, meta = self._connection.call(lambda c: c.get(self._key))
        return None if value is None else (value, meta.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        lease = self._lease.get()

        def transaction(client: Any) -> tuple[bool, list]:
            txn = client.transactions
            if token is None:
                compare = [txn.version(self._key) == 0]
            else:
                compare = [txn.mod(self._key) == int(token)]
            return client.transaction(compare=compare, success=[txn.put(self._key, state, lease), txn.get(self._key)],
                                      failure=[txn.get(self._key)])

        try:
            int(token) if token is not None else None
        except (TypeError, ValueError):
            current = self.get_state()
            return None if current is None else (*current, False)
        succeeded, responses = self._connection.call(transaction)
        found = responses[-1]
        if not found:
            return None
        value, meta = found[0]
        return value, meta.mod_revision, succeeded

    def watch_state(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from a background thread) whenever the state key changes."""
        threading.Thread(target=self._watch, args=(callback,), name="torchrevive-etcd3-watch", daemon=True).start()

    def _watch(self, callback: Callable[[], None]) -> None:
        while True:
            try:
                self._connection.call(lambda c: self._follow(c, callback))
            except RendezvousError:  # etcd unreachable for read_timeout: keep trying; meanwhile the watch polls
                logger.debug("etcd watch on %s ended; re-establishing", self._key, exc_info=True)
            time.sleep(0.5)

    def _follow(self, client: Any, callback: Callable[[], None]) -> None:
        """Call ``callback`` on every change of the state key until the watch breaks (raises)."""
        events, cancel = client.watch(self._key)
        try:
            for _ in events:
                callback()
        finally:
            cancel()


class Etcd3Store(Store):
    """A torch ``Store`` over etcd v3 keys under a prefix (values are bytes)."""

    def __init__(self, connection: Etcd3Connection, prefix: str, lease: Etcd3Lease,
                 timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self._connection = connection
        self._prefix = prefix.rstrip("/") + "/"
        self._lease = lease
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: str | bytes) -> None:
        self._connection.call(lambda c: c.put(self._key(key), _bytes(value), self._lease.get()))

    def get(self, key: str) -> bytes:
        return self._values_when_set([key], self.timeout)[0]

    def add(self, key: str, num: int) -> int:
        full = self._key(key)
        while True:
            value, meta = self._connection.call(lambda c: c.get(full))
            new = (int(value) if value is not None else 0) + num

            def transaction(client: Any, value: bytes | None = value, meta: Any = meta, new: int = new) -> bool:
                txn = client.transactions
                compare = [txn.version(full) == 0] if value is None else [txn.mod(full) == meta.mod_revision]
                succeeded, _ = client.transaction(compare=compare, success=[txn.put(full, str(new), self._lease.get())],
                                                  failure=[])
                return succeeded

            if self._connection.call(transaction):
                return new

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        full, expected, desired = self._key(key), _bytes(expected_value), _bytes(desired_value)

        def transaction(client: Any) -> tuple[bool, list]:
            txn = client.transactions
            compare = [txn.version(full) == 0] if not expected else [txn.value(full) == expected]
            return client.transaction(compare=compare, success=[txn.put(full, desired, self._lease.get())],
                                      failure=[txn.get(full)])

        succeeded, responses = self._connection.call(transaction)
        if succeeded:
            return desired
        return responses[0][0][0] if responses[0] else expected

    def keys_under(self, prefix: str) -> list[str]:
        """The keys set under ``prefix`` (without this store's own prefix), in one range read."""
        found = self._connection.call(lambda c: list(c.get_prefix(self._key(prefix), keys_only=True)))
        return [meta.key.decode()[len(self._prefix):] for _, meta in found]

    def check(self, keys: list[str]) -> bool:
        return all(value is not None for value in self._values(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._values_when_set(keys, timeout or self.timeout)

    def _values(self, keys: list[str]) -> list[bytes | None]:
        return [self._connection.call(lambda c, k=k: c.get(self._key(k)))[0] for k in keys]

    def _values_when_set(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        """The keys' values, read again with backoff until every one is set (or ``timeout``)."""
        limit = timeout.total_seconds()
        deadline = time.monotonic() + limit
        delay = 0.01
        while None in (values := self._values(keys)):
            if time.monotonic() > deadline:
                raise LookupError(f"etcd3 store: keys {keys} under {self._prefix} not set within {limit:.0f} s")
            time.sleep(delay)
            delay = min(0.5, delay * 2)
        return values

    def delete_key(self, key: str) -> bool:
        return bool(self._connection.call(lambda c: c.delete(self._key(key))))

    def delete_keys(self, keys: list[str]) -> None:
        """Delete ``keys`` (those that exist), MAX_DELETES to a transaction."""
        for start in range(0, len(keys), MAX_DELETES):
            batch = [self._key(key) for key in keys[start:start + MAX_DELETES]]
            self._connection.call(lambda c, batch=batch: c.transaction(
                compare=[], success=[c.transactions.delete(key) for key in batch], failure=[]))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)


def options_from(params: RendezvousParameters) -> Etcd3Options:
    """Connection options from ``--rdzv-endpoint host:port[,host:port...]``, ``--rdzv-conf`` and
    TORCHREVIVE_ETCD_PASSWORD, which is removed from this process' environment once read (workers
    inherit the agent's environment)."""
    endpoints = tuple(parse_rendezvous_endpoint(e.strip(), default_port=DEFAULT_PORT)
                      for e in params.endpoint.split(",") if e.strip())
    if not endpoints:
        raise ValueError("the etcd3 rendezvous needs --rdzv-endpoint HOST:PORT (several, comma-separated, for a cluster)")
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError(f"rdzv-conf read_timeout={read_timeout}: must be a positive number of seconds")
    user = params.get("user")
    from_environment = os.environ.pop(PASSWORD_ENV, None)
    options = etcd3_client.Etcd3Options(
        endpoints=endpoints,
        ca_cert=_ca_cert(params),
        cert=params.get("ssl_cert"),
        cert_key=params.get("ssl_cert_key"),
        user=user,
        password=_password(params, from_environment) if user is not None else _no_password(params),
        read_timeout=float(read_timeout),
    )
    if options.password is not None and options.ca_cert is None:
        _warn_plaintext_password(params.endpoint, str(user))
    return options


def _ca_cert(params: RendezvousParameters) -> str | None:
    """``ca_cert``, which turns TLS on; torch's ``protocol`` is accepted, and ``https`` without a
    CA refused (it would connect in plaintext, unlike what it says)."""
    ca_cert = params.get("ca_cert")
    protocol = str(params.get("protocol", "http" if ca_cert is None else "https"))
    if protocol not in ("http", "https"):
        raise ValueError(f"rdzv-conf protocol={protocol}: must be http or https")
    if (protocol == "https") != (ca_cert is not None):
        raise ValueError(f"rdzv-conf protocol={protocol} with{'out' if ca_cert is None else ''} ca_cert: TLS is on "
                         "exactly when ca_cert names the CA that signed etcd's certificate; give both "
                         "protocol=https,ca_cert=FILE, or neither")
    return ca_cert


_warned_plaintext: set[str] = set()
"""The endpoints already warned of (a password sent without TLS): once each per process."""


def _warn_plaintext_password(endpoint: str, user: str) -> None:
    """A password over plaintext can be read by anyone on the path, who can then write the
    rendezvous: say so once, with the fix."""
    if endpoint in _warned_plaintext:
        return
    _warned_plaintext.add(endpoint)
    message = (f"the etcd3 rendezvous sends user {user}'s password to {endpoint} without TLS: anyone on the "
               "network path can read it and then rewrite the rendezvous. Serve etcd over TLS and give its CA: "
               "--rdzv-conf protocol=https,ca_cert=/path/to/ca.pem (rendezvous.conf)")
    warnings.warn(message, UserWarning, stacklevel=3)
    logger.warning(message)


def _password(params: RendezvousParameters, from_environment: str | None) -> str:
    """The etcd password: from ``password_file``, ``password`` or TORCHREVIVE_ETCD_PASSWORD."""
    password, path = params.get("password"), params.get("password_file")
    if password is not None and path is not None:
        raise ValueError("rdzv-conf has both password and password_file; keep password_file (a file only the job's "
                         "user can read keeps the password out of the command line and the config)")
    if path is not None:
        try:
            return Path(path).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"rdzv-conf password_file={path}: cannot read the etcd password ({exc.strerror}); "
                             "give a file the agent can read") from exc
    if password is None and from_environment is None:
        raise ValueError(f"rdzv-conf user={params.get('user')} needs a password: set password_file in "
                         f"rendezvous.conf, or {PASSWORD_ENV} in the agent's environment")
    return password if password is not None else from_environment


def _no_password(params: RendezvousParameters) -> None:
    """Without a user there is no password to give: refuse one (etcd would ignore it silently)."""
    if params.get("password") is not None or params.get("password_file") is not None:
        raise ValueError("rdzv-conf has a password but no user; add user=NAME (etcd authenticates a user)")


def create_etcd3_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's DynamicRendezvousHandler over the etcd3 backend and store."""
    layout = heartbeat_layout(params)
    connection = etcd3_client.Etcd3Connection(options_from(params))
    prefix = str(params.get("key_prefix", DEFAULT_PREFIX)).rstrip("/")
    lease_ttl = params.get_as_int("lease_ttl") or default_lease_ttl_s(*keep_alive(params))
    lease = Etcd3Lease(connection, lease_ttl)
    backend: Etcd3RendezvousBackend | Etcd3MembersBackend
    if layout == "keys":
        backend = Etcd3MembersBackend(connection, params.run_id, prefix=prefix, lease=lease,
                                      heartbeat_timeout_s=heartbeat_timeout_s(params))
    else:
        backend = Etcd3RendezvousBackend(connection, params.run_id, prefix=prefix, lease=lease)
    store = Etcd3Store(connection, f"{prefix}/{params.run_id}/store", lease)
    handler = create_handler(store, backend, params)
    if isinstance(backend, Etcd3MembersBackend):
        backend.bind_node(torch_private.this_node(handler))
    CheckedBackend.install(handler, f"the etcd key {backend.key} (at {params.endpoint})")
    _tolerate_outages(handler, connection)
    _release_on_shutdown(handler, [lease.close, *([backend.close] if isinstance(backend, Etcd3MembersBackend) else [])])
    return handler


def _release_on_shutdown(handler: DynamicRendezvousHandler, closers: list[Callable[[], None]]) -> None:
    """After torch's shutdown of the handler (the agent's end), stop this handler's own threads: the
    lease's refresher and the members' watch no longer call etcd. (The etcd3 client's own watch
    thread stays, idle: it ends only with an error when its channel closes.)"""
    shutdown = handler.shutdown

    def shutdown_then_release() -> bool:
        try:
            return shutdown()
        finally:
            for close in closers:
                close()

    handler.shutdown = shutdown_then_release  # type: ignore[method-assign]


def heartbeat_layout(params: RendezvousParameters) -> str:
    """``heartbeats`` in rendezvous.conf: ``keys`` (default: a leased key per node, see
    etcd3_members: what a keep-alive costs etcd does not grow with the node count) or ``state``
    (torch's layout, every heartbeat inside the shared state, which every node rewrites each
    keep-alive)."""
    layout = str(params.get("heartbeats", "keys"))
    if layout not in HEARTBEAT_LAYOUTS:
        raise ValueError(f"rdzv-conf heartbeats={layout}: must be one of {', '.join(HEARTBEAT_LAYOUTS)}")
    return layout


def keep_alive(params: RendezvousParameters) -> tuple[int, int]:
    """(keep_alive_interval, keep_alive_max_attempt), with torch's defaults (5 s, 3)."""
    interval = params.get_as_int("keep_alive_interval", 0) or int(TORCH_RENDEZVOUS_DEFAULTS_S["keep_alive_interval"])
    return interval, params.get_as_int("keep_alive_max_attempt", 0) or TORCH_KEEP_ALIVE_MAX_ATTEMPT


def heartbeat_timeout_s(params: RendezvousParameters) -> int:
    """keep_alive_interval x keep_alive_max_attempt, with torch's defaults (5 s x 3)."""
    interval, attempts = keep_alive(params)
    return interval * attempts


def _tolerate_outages(handler: DynamicRendezvousHandler, connection: Etcd3Connection) -> None:
    """Drop nodes for lapsed heartbeats only once every node could write one since etcd came back.

    The dynamic rendezvous keeps heartbeats as timestamps in the state and drops any node whose
    last one is older than keep_alive_interval x keep_alive_max_attempt. While etcd is down nobody
    can write one, so the first agent to reach etcd again would drop every other node, and a healthy
    job would restart. After an outage this waits one heartbeat timeout, plus a keep-alive period
    and the client's largest retry delay, before torch's clean-up runs again.
    """
    settings = handler.settings
    grace = etcd_outage_grace_s(settings.keep_alive_interval.total_seconds(), settings.keep_alive_max_attempt)

    def after_grace(holder: Any, cleanup: Callable[[], None]) -> Callable[[], None]:
        def cleanup_after_grace() -> None:
            if time.monotonic() - connection.reachable_since >= grace:
                cleanup()

        return cleanup_after_grace

    torch_private.wrap_state_cleanup(handler, after_grace)


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it and registers what it returns."""
    return create_etcd3_handler


def register() -> None:
    """Register the backend under its names (a no-op where the entry point already did)."""
    for name in NAMES:
        if name not in torch_private.registered_rendezvous_backends():
            rendezvous_handler_registry.register(name, create_etcd3_handler)


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
