"""A rendezvous backend whose states are checked before torch unpickles them.

torch's dynamic rendezvous keeps its state as a pickle in the backend (c10d's store key, etcd) and
its state holder reads it back with ``pickle.loads``: whoever can write that key (anyone who
reaches the unauthenticated c10d store, or holds etcd write access) would run code in every agent.
:class:`CheckedBackend` gives torch only bytes that :func:`agent.rendezvous.round_state.decode`
(an unpickler that builds nothing but the state's own types) accepted, and raises torch's own
``RendezvousStateError`` for anything else, as torch does for a corrupt state.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
)

from agent import torch_private
from agent.rendezvous import round_state


class CheckedBackend(RendezvousBackend):
    """``backend``, whose every state read or written back is checked by the allowlist unpickler
    first; other attributes (etcd3's ``watch_state``, ``lapsed``) are ``backend``'s own.

    Args:
        backend: the backend torch's state holder used.
        where: the key the state lives under, for error messages.
    """

    def __init__(self, backend: RendezvousBackend, where: str) -> None:
        self.inner = backend
        self._where = where
        self._accepted = b""
        """The last state accepted: read again unchanged (a waiting node reads often), it is not decoded again."""

    @classmethod
    def install(cls, handler: DynamicRendezvousHandler, where: str) -> None:
        """Check every state ``handler`` reads (once per handler: a second call changes nothing)."""
        backend = torch_private.state_backend(handler)
        if not isinstance(backend, cls):
            torch_private.set_state_backend(handler, cls(backend, where))

    @property
    def name(self) -> str:
        return self.inner.name

    def get_state(self) -> tuple[bytes, Token] | None:
        found = self.inner.get_state()
        if found is not None:
            self._check(found[0])
        return found

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        found = self.inner.set_state(state, token)
        if found is not None:
            self._check(found[0])
        return found

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _check(self, state: bytes) -> None:
        if state != self._accepted:
            round_state.decode(state, self._where)
            self._accepted = state
