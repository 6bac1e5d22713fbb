"""A running job's rendezvous, read from outside the job and read-only (``torchrevive status``):
the round's state and the values its agents publish in the job's store, on the c10d store or on
etcd3, without joining, writing or holding a lease.

The state is data from the network: it is decoded by :func:`agent.rendezvous.round_state.decode`,
which builds nothing but the state's own types, never by plain ``pickle``. Nothing listening at the
endpoint is :class:`RendezvousUnreachable`, naming the endpoint and what to do.
"""

from __future__ import annotations

import base64
import binascii
import socket
from datetime import timedelta
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT as C10D_DEFAULT_PORT
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from agent.errors import TorchreviveError
from agent import torch_private
from agent.rendezvous import round_state

if TYPE_CHECKING:
    from agent.torch_private import RendezvousState

T = TypeVar("T")
BACKENDS = ("c10d", "etcd3", "etcd-v3")
"""The backends whose state can be read: torch's dynamic rendezvous on c10d, and etcd3's."""


class RendezvousUnreachable(TorchreviveError):
    """Nothing answers at the rendezvous endpoint."""


class RendezvousReader(Protocol):
    """One job's rendezvous, read-only."""

    where: str
    """The backend and endpoint, for messages."""

    def state(self) -> tuple[RendezvousState | None, frozenset[str] | None]:
        """The round's state (None before any node joined) and, where the backend keeps heartbeats
        as keys of their own (etcd3's default), the nodes whose heartbeat key lives; else None."""

    def job_value(self, key: str) -> bytes | None:
        """``key`` of the job's rendezvous store, None when it is not set."""


def open_reader(backend: str, endpoint: str, run_id: str, conf: dict[str, Any], *,
                timeout_s: float) -> RendezvousReader:
    """A reader of run ``run_id``'s rendezvous on ``backend`` (one of :data:`BACKENDS`) at
    ``endpoint`` (``conf``: the rendezvous options as torch reads them); RendezvousUnreachable when
    nothing answers within ``timeout_s``, ValueError for etcd3 options that do not hold."""
    if backend == "c10d":
        return C10dReader(endpoint, run_id, timeout_s=timeout_s)
    return Etcd3Reader(endpoint, run_id, conf, timeout_s=timeout_s)


class C10dReader:
    """The c10d backend's store (a TCPStore hosted by one agent), as a client that only reads."""

    def __init__(self, endpoint: str, run_id: str, *, timeout_s: float) -> None:
        import torch.distributed as dist

        host, port = parse_rendezvous_endpoint(endpoint, default_port=C10D_DEFAULT_PORT)
        self.where = f"the c10d rendezvous store at {host}:{port}"
        self._run_id = run_id
        try:  # a plain connection first: torch's client retries a refused one until its timeout, loudly
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            raise RendezvousUnreachable(
                f"nothing answers at {host}:{port} ({exc.strerror or exc}): no c10d rendezvous store listens there. "
                "Is the job running? Give the endpoint its agents were given (--rdzv-endpoint HOST:PORT, the node "
                "that hosts the store; or rendezvous.endpoint in --config)") from exc
        try:
            self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise RendezvousUnreachable(f"{host}:{port} accepts connections but does not answer as a c10d store "
                                        f"({str(exc).splitlines()[0]}): check --rdzv-endpoint") from exc

    def state(self) -> tuple[RendezvousState | None, frozenset[str] | None]:
        where = f"the c10d rendezvous state of run '{self._run_id}' ({self.where})"
        stored = self.job_value(torch_private.c10d_state_key(self._run_id))
        if stored is None or stored == torch_private.C10D_NO_STATE:
            return None, None
        try:
            data = base64.b64decode(stored, validate=True)
        except binascii.Error as exc:
            raise RendezvousStateError(f"{where} is not base64 ({exc})") from exc
        return round_state.decode(data, where), None

    def job_value(self, key: str) -> bytes | None:
        try:
            # check, then get: a get of a missing key would wait out the whole timeout.
            return self._store.get(key) if self._store.check([key]) else None
        except RuntimeError as exc:
            raise RendezvousUnreachable(f"{self.where} stopped answering ({str(exc).splitlines()[0]}): the node "
                                        "hosting it may be gone; run status again") from exc


class Etcd3Reader:
    """The etcd3 backend's keys, read with plain gets: under ``<key_prefix>/<run_id>/``, the round
    (``members/round``) and a heartbeat key per live node (``members/node/<name>``) as
    :mod:`agent.rendezvous.etcd3_members` writes them, or the whole state (``state``) with
    ``heartbeats=state``; the job's store under ``store/`` (:class:`~agent.rendezvous.etcd3_backend.Etcd3Store`)."""

    def __init__(self, endpoint: str, run_id: str, conf: dict[str, Any], *, timeout_s: float) -> None:
        from agent.rendezvous.etcd3_backend import DEFAULT_PREFIX, heartbeat_layout, options_from
        from agent.rendezvous.etcd3_client import Etcd3Connection

        conf = {**conf, "read_timeout": max(1, round(timeout_s))}
        params = RendezvousParameters(backend="etcd3", endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1,
                                      **conf)
        self.where = f"etcd at {endpoint}"
        self._timeout_s = timeout_s
        self._root = f"{str(params.get('key_prefix', DEFAULT_PREFIX)).rstrip('/')}/{run_id}"
        self._keys_layout = heartbeat_layout(params) == "keys"
        self._connection = Etcd3Connection(options_from(params))
        self._call(lambda c: c.status())

    def state(self) -> tuple[RendezvousState | None, frozenset[str] | None]:
        key = f"{self._root}/members/round" if self._keys_layout else f"{self._root}/state"
        value, _ = self._call(lambda c: c.get(key))
        if value is None:
            return None, None
        state = round_state.decode(value, f"the etcd key {key} ({self.where})")
        if not self._keys_layout:
            return state, None
        prefix = f"{self._root}/members/node/"
        found = self._call(lambda c: list(c.get_prefix(prefix, keys_only=True)))
        return state, frozenset(meta.key.decode()[len(prefix):] for _, meta in found)

    def job_value(self, key: str) -> bytes | None:
        return self._call(lambda c: c.get(f"{self._root}/store/{key}"))[0]

    def _call(self, operation: Callable[[Any], T]) -> T:
        try:
            return self._connection.call(operation)
        except RendezvousConnectionError as exc:
            cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else exc
            raise RendezvousUnreachable(f"nothing answers as etcd at {self._connection.options.describe()} within "
                                        f"{self._timeout_s:.0f} s ({cause}). Is etcd running there, and is this the "
                                        "job's --rdzv-endpoint (rendezvous.endpoint in --config)? A slow etcd: raise "
                                        "--timeout") from exc
