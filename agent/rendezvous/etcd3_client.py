"""A connection to an etcd v3 cluster for the etcd3 rendezvous backend: the ``etcd3`` client,
imported so that it works beside current protobuf, with failover across endpoints and retries with
backoff during short outages.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

T = TypeVar("T")
MAX_RETRY_DELAY_S = 2.0
"""The longest wait between two retries of an unreachable cluster."""
_PROTOBUF_IMPLEMENTATION = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"


def import_etcd3() -> Any:
    """Import the ``etcd3`` package.

    etcd3 0.12.0 (its last release, 2020) ships protobuf modules generated for protobuf 3, which
    protobuf >= 4's C (upb) implementation refuses ("Descriptors cannot be created directly").
    The pure-Python implementation still accepts them, and protobuf picks its implementation
    once, at its first import, from PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION. This is the one place
    that selects it; when protobuf was already imported with another implementation, the error
    says how to fix it.
    """
    if "etcd3" in sys.modules:
        return sys.modules["etcd3"]
    if "google.protobuf" not in sys.modules:
        os.environ.setdefault(_PROTOBUF_IMPLEMENTATION, "python")
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
    return etcd3


@dataclass(frozen=True)
class Etcd3Options:
    """How to reach etcd: endpoints (host, port), TLS files, credentials, timeouts."""

    endpoints: tuple[tuple[str, int], ...]
    ca_cert: str | None = None
    cert: str | None = None
    cert_key: str | None = None
    user: str | None = None
    password: str | None = None
    read_timeout: float = 60.0
    """How long an operation keeps retrying an unreachable cluster before it fails."""
    request_timeout: float = 5.0

    def describe(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)


class Etcd3Connection:
    """One client at a time, on one endpoint; an operation that cannot reach it moves on to the
    next endpoint and retries with backoff, for up to ``read_timeout``."""

    def __init__(self, options: Etcd3Options) -> None:
        self.options = options
        self._etcd3 = import_etcd3()
        self._endpoint = 0
        self._client: Any = None
        self.reachable_since = time.monotonic()
        """When the cluster last became reachable again after an outage (or when this connection was made)."""

    @property
    def client(self) -> Any:
        if self._client is None:
            host, port = self.options.endpoints[self._endpoint]
            o = self.options
            self._client = self._etcd3.client(host=host, port=port, ca_cert=o.ca_cert, cert_key=o.cert_key,
                                              cert_cert=o.cert, timeout=o.request_timeout, user=o.user,
                                              password=o.password)
        return self._client

    def call(self, operation: Callable[[Any], T]) -> T:
        """Run ``operation(client)``, retrying connection failures until ``read_timeout``."""
        errors = self._etcd3.exceptions
        deadline = time.monotonic() + self.options.read_timeout
        delay = 0.1
        failed = False
        while True:
            try:
                result = operation(self.client)
                if failed:
                    self.reachable_since = time.monotonic()
                return result
            except (errors.ConnectionFailedError, errors.ConnectionTimeoutError) as exc:
                failed = True
                if time.monotonic() + delay > deadline:
                    raise RendezvousConnectionError(
                        f"etcd at {self.options.describe()} unreachable for {self.options.read_timeout:.0f} s "
                        f"({type(exc).__name__}); check that etcd runs there, or raise read_timeout in "
                        "rendezvous.conf") from exc
                self._failover()
                time.sleep(delay)
                delay = min(MAX_RETRY_DELAY_S, delay * 2)

    def _failover(self) -> None:
        self._endpoint = (self._endpoint + 1) % len(self.options.endpoints)
        if self._client is not None:
            self._client.close()
        self._client = None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
