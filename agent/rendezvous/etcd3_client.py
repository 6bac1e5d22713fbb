"""A connection to an etcd v3 cluster for the etcd3 rendezvous backend: the ``etcd3`` client,
imported so that it works beside current protobuf, shared by the agent's threads, with failover
across endpoints, retries with backoff during outages, and a new auth token after etcd restarts.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from agent.timeouts import MAX_RETRY_DELAY_S

logger = logging.getLogger(__name__)

T = TypeVar("T")
_PROTOBUF_IMPLEMENTATION = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"
_STALE_TOKEN_DETAILS = ("invalid auth token", "revision of auth store is old")
"""etcd's answers to a token it no longer knows (it restarted, or its auth store changed)."""

Problem = Literal["unreachable", "stale_token"]

_WATCH_THREAD_PREFIX = "etcd3_watch_"
"""etcd3's name for a client's watch thread: ``etcd3_watch_<id of its Watcher>``."""
_quiet_watch_ends_lock = threading.Lock()
_quiet_watch_ends_installed = False


def import_etcd3() -> Any:
    """Import the ``etcd3`` package.

    etcd3 0.12.0 (its last release, 2020) ships protobuf modules generated for protobuf 3, which
    protobuf >= 4's C (upb) implementation refuses ("Descriptors cannot be created directly").
    The pure-Python implementation still accepts them, and protobuf picks its implementation
    once, at its first import, from PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION. This is the one place
    that selects it, for this process alone: the variable is removed again after the import
    (unless the user had set it), so that workers, which inherit the agent's environment, keep
    protobuf's fast implementation. When protobuf was already imported with another
    implementation, the error says how to fix it.
    """
    if "etcd3" in sys.modules:
        return sys.modules["etcd3"]
    chosen_here = "google.protobuf" not in sys.modules and _PROTOBUF_IMPLEMENTATION not in os.environ
    if chosen_here:
        os.environ[_PROTOBUF_IMPLEMENTATION] = "python"
    try:
        import etcd3
    except ImportError as exc:
        raise RendezvousConnectionError(
            "the etcd3 rendezvous backend needs the etcd3 client: pip install 'torchrevive[etcd]'") from exc
    except TypeError as exc:  # protobuf's refusal of the old generated modules
        from google.protobuf.internal import api_implementation

        raise RendezvousConnectionError(
            f"the etcd3 client cannot load with protobuf's {api_implementation.Type()!r} implementation, which "
            f"this process selected before torchrevive could: set {_PROTOBUF_IMPLEMENTATION}=python in the "
            "environment") from exc
    finally:
        if chosen_here:
            del os.environ[_PROTOBUF_IMPLEMENTATION]
    return etcd3


def quiet_watch_thread_ends() -> None:
    """Keep the end of a closed client's watch thread out of the log (once per process).

    An etcd3 client's watch thread re-opens its stream for as long as the client lives; the only
    way to end it is to close the client's channel, and the thread then ends with
    ``ValueError: Cannot invoke RPC: Channel closed!``, whose traceback would be printed at every
    failover. That end alone is silenced; any other exception goes to the previous hook.
    """
    global _quiet_watch_ends_installed
    with _quiet_watch_ends_lock:
        if _quiet_watch_ends_installed:
            return
        _quiet_watch_ends_installed = True
        previous = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            if args.thread is not None and args.thread.name.startswith(_WATCH_THREAD_PREFIX) \
                    and isinstance(args.exc_value, ValueError) and "Channel closed" in str(args.exc_value):
                return
            previous(args)

        threading.excepthook = hook


@dataclass(frozen=True)
class Etcd3Options:
    """How to reach etcd: endpoints (host, port), TLS files, credentials, timeouts."""

    endpoints: tuple[tuple[str, int], ...]
    ca_cert: str | None = None
    cert: str | None = None
    cert_key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    read_timeout: float = 60.0
    """How long an operation keeps retrying an unreachable cluster, from its first failure."""
    request_timeout: float = 5.0

    def describe(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)


class Etcd3Connection:
    """One etcd3 client shared by every thread of the agent (its gRPC channel is thread-safe), on
    one endpoint at a time.

    An operation that cannot reach etcd moves the connection to the next endpoint and is retried
    with backoff until ``read_timeout`` after its first failure; one refused for a stale auth token
    (etcd restarted) is retried on a client that authenticates again. A replaced client is closed
    by the last operation that used it, never under another thread.
    """

    def __init__(self, options: Etcd3Options) -> None:
        self.options = options
        self._etcd3 = import_etcd3()
        quiet_watch_thread_ends()
        import grpc  # installed with etcd3

        self._grpc = grpc
        self._lock = threading.Lock()
        """Guards the fields below. Held to pick the client or make one (a single authenticate
        call, bounded by request_timeout), never across an operation or a retry."""
        self._endpoint = 0
        self._client: Any = None
        self._users: Counter[Any] = Counter()
        self._retired: set[Any] = set()
        self._reachable_since = time.monotonic()
        self._failing = False

    @property
    def reachable_since(self) -> float:
        """When the cluster last became reachable again after an outage (or when this connection was made)."""
        with self._lock:
            return self._reachable_since

    def call(self, operation: Callable[[Any], T]) -> T:
        """Run ``operation(client)``; retry connection failures until ``read_timeout`` after the first."""
        first_failure: float | None = None
        delay = 0.1
        while True:
            client = None
            try:
                client = self._acquire()
                result = operation(client)
            except Exception as exc:
                problem = self._problem(exc)
                if problem is None:
                    raise
                if client is not None:
                    self._replace(client, next_endpoint=problem == "unreachable")
                with self._lock:
                    self._failing = True
                now = time.monotonic()
                first_failure = first_failure or now
                if now + delay > first_failure + self.options.read_timeout:
                    raise RendezvousConnectionError(
                        f"etcd at {self.options.describe()} unreachable for {self.options.read_timeout:.0f} s "
                        f"({_describe(exc)}); check that etcd runs there, or raise read_timeout in "
                        "rendezvous.conf") from exc
                logger.debug("etcd operation failed (%s); retrying in %.1f s", _describe(exc), delay)
                time.sleep(delay)
                delay = min(MAX_RETRY_DELAY_S, delay * 2)
                continue
            finally:
                if client is not None:
                    self._release(client)
            with self._lock:
                if self._failing:
                    self._failing, self._reachable_since = False, time.monotonic()
            return result

    def _acquire(self) -> Any:
        """The current client (made on first use), counted as in use until :meth:`_release`."""
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._new_client(*self.options.endpoints[self._endpoint])
                except Exception as exc:
                    if self._problem(exc) == "unreachable":
                        self._next_endpoint()
                    raise
            self._users[self._client] += 1
            return self._client

    def _release(self, client: Any) -> None:
        with self._lock:
            self._users[client] -= 1
            if self._users[client] <= 0:
                del self._users[client]
                if client in self._retired:
                    self._retired.discard(client)
                    client.close()

    def _replace(self, client: Any, *, next_endpoint: bool) -> None:
        """Retire ``client`` if it is still the current one (another thread may have replaced it
        already); the next operation makes a new one, on the next endpoint if asked."""
        with self._lock:
            if self._client is not client:
                return
            self._client = None
            self._retired.add(client)
            if next_endpoint:
                self._next_endpoint()

    def _next_endpoint(self) -> None:
        self._endpoint = (self._endpoint + 1) % len(self.options.endpoints)

    def _new_client(self, host: str, port: int) -> Any:
        o = self.options
        try:
            return self._etcd3.client(host=host, port=port, ca_cert=o.ca_cert, cert_key=o.cert_key, cert_cert=o.cert,
                                      timeout=o.request_timeout, user=o.user, password=o.password)
        except self._grpc.RpcError as exc:
            if exc.code() == self._grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in (exc.details() or ""):
                raise RendezvousConnectionError(
                    f"etcd at {host}:{port} refused user '{o.user}' ({exc.details()}); check rendezvous.conf user "
                    "and the password (password_file, or TORCHREVIVE_ETCD_PASSWORD)") from exc
            raise

    def _problem(self, exc: BaseException) -> Problem | None:
        """What a failed operation ran into, when retrying can help."""
        errors = self._etcd3.exceptions
        if isinstance(exc, (errors.ConnectionFailedError, errors.ConnectionTimeoutError, errors.WatchTimedOut)):
            return "unreachable"
        if isinstance(exc, self._grpc.RpcError):
            code, details = exc.code(), exc.details() or ""
            if code in (self._grpc.StatusCode.UNAVAILABLE, self._grpc.StatusCode.DEADLINE_EXCEEDED):
                return "unreachable"
            if code == self._grpc.StatusCode.UNAUTHENTICATED or any(d in details for d in _STALE_TOKEN_DETAILS):
                return "stale_token"
        return None

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._retired.add(self._client)
                self._client = None
            for client in [c for c in self._retired if not self._users[c]]:
                self._retired.discard(client)
                client.close()


def _describe(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    return f"{type(exc).__name__}: {details()}" if callable(details) else type(exc).__name__
