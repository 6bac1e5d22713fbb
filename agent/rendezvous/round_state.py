"""torch's dynamic rendezvous state (``RendezvousState``, pickled) split into the round, which
every node shares, and the heartbeats, which each node keeps on its own, and joined again.

The etcd3 backend stores the round without heartbeats and keeps each node's heartbeat as a leased
key of its own, so that a keep-alive rewrites nothing shared. A stored round is data from the
network: it is read back with an unpickler that builds only what the state is made of (torch's
state and node classes, datetimes, built-in containers) and refuses anything else, and every
state torch's handler unpickles on any backend passes that check first
(:mod:`agent.rendezvous.checked_backend`).
"""

from __future__ import annotations

import io
import pickle
from datetime import datetime
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.rendezvous.api import RendezvousStateError

# The module, not its names: torch loads the etcd3 backend (an entry point) while it imports its
# own rendezvous package, and this module with it, possibly from inside torch_private's first import.
from agent import torch_private

if TYPE_CHECKING:
    from agent.torch_private import NodeDesc, RendezvousState

_DATETIME_TYPES = {("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta")}
_COMPARED = ("round", "complete", "deadline", "closed", "participants", "wait_list", "redundancy_list")
"""The round's fields: everything of the state but the heartbeats."""


class _StateUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        state, node = torch_private.RendezvousState, torch_private.NodeDesc
        allowed = _DATETIME_TYPES | {(state.__module__, state.__qualname__), (node.__module__, node.__qualname__)}
        if (module, name) not in allowed:
            raise RendezvousStateError(f"{self._where} holds {module}.{name}, which a rendezvous state never holds: "
                                       "something other than a rendezvous wrote it. Nothing of it was run; delete "
                                       "the key, or use another rendezvous id (--rdzv-id) or key_prefix")
        return super().find_class(module, name)


def decode(data: bytes, where: str = "the stored rendezvous round") -> RendezvousState:
    """A state from its pickle, building nothing but the state's own types, and shaped as torch
    makes it; RendezvousStateError (naming ``where``, the key it was read from) otherwise."""
    try:
        state = _StateUnpickler(data, where).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            MemoryError, RecursionError) as exc:
        raise RendezvousStateError(f"{where} is corrupt ({exc}); delete the key, or use another rendezvous id "
                                   "(--rdzv-id)") from exc
    if not isinstance(state, torch_private.RendezvousState):
        raise RendezvousStateError(f"{where} is a {type(state).__name__}, not a rendezvous state; delete the key, "
                                   "or use another rendezvous id (--rdzv-id)")
    problem = _shape_problem(state)
    if problem:
        raise RendezvousStateError(f"{where} is not a rendezvous state as torch writes it ({problem}); delete the "
                                   "key, or use another rendezvous id (--rdzv-id)")
    return state


def _shape_problem(state: RendezvousState) -> str:
    """What in ``state`` torch's rendezvous would trip over ("" when nothing): its fields' types."""
    node, moment = torch_private.NodeDesc, datetime
    fields = getattr(state, "__dict__", {})
    checks = {
        "round": lambda v: type(v) is int,
        "complete": lambda v: type(v) is bool,
        "closed": lambda v: type(v) is bool,
        "deadline": lambda v: v is None or isinstance(v, moment),
        "participants": lambda v: isinstance(v, dict) and all(isinstance(k, node) and type(r) is int
                                                                for k, r in v.items()),
        "wait_list": lambda v: isinstance(v, set) and all(isinstance(k, node) for k in v),
        "redundancy_list": lambda v: isinstance(v, set) and all(isinstance(k, node) for k in v),
        "last_heartbeats": lambda v: isinstance(v, dict) and all(isinstance(k, node) and isinstance(t, moment)
                                                                   for k, t in v.items()),
    }
    bad = [name for name, valid in checks.items() if name not in fields or not valid(fields[name])]
    if bad:
        return f"{', '.join(bad)} missing or of the wrong type"
    if not all(_node_valid(n) for n in listed(state)):
        return "a node whose addr, pid or local_id is of the wrong type"
    return ""


def _node_valid(node: NodeDesc) -> bool:
    fields = getattr(node, "__dict__", {})
    return (isinstance(fields.get("addr"), str) and type(fields.get("pid")) is int
            and type(fields.get("local_id")) is int)


def encode(state: RendezvousState) -> bytes:
    return pickle.dumps(state)


def node_name(node: NodeDesc) -> str:
    """The node's name as torch writes it (``addr_pid_localid``): its heartbeat key's last part."""
    return repr(node)


def split(state: RendezvousState) -> tuple[RendezvousState, dict[str, datetime]]:
    """The round (``state`` itself, its heartbeats emptied) and the heartbeats by node name."""
    heartbeats = {node_name(node): moment for node, moment in state.last_heartbeats.items()}
    state.last_heartbeats = {}
    return state, heartbeats


def listed(state: RendezvousState) -> set[NodeDesc]:
    """Every node the round knows: participants, waiting and redundant nodes (each has a heartbeat)."""
    return set(state.participants) | state.wait_list | state.redundancy_list


def same_round(a: RendezvousState, b: RendezvousState) -> bool:
    """Whether two states hold the same round (heartbeats aside; sets compared as sets, so the
    pickles' byte order, which follows each process' hash seed, does not matter)."""
    return all(getattr(a, field) == getattr(b, field) for field in _COMPARED)
