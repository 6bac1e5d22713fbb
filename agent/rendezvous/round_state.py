"""torch's dynamic rendezvous state (``RendezvousState``, pickled) split into the round, which
every node shares, and the heartbeats, which each node keeps on its own, and joined again.

The etcd3 backend stores the round without heartbeats and keeps each node's heartbeat as a leased
key of its own, so that a keep-alive rewrites nothing shared. A stored round is data from the
network: it is read back with an unpickler that builds only what the state is made of (torch's
state and node classes, datetimes, built-in containers) and refuses anything else.
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
    def find_class(self, module: str, name: str) -> Any:
        state, node = torch_private.RendezvousState, torch_private.NodeDesc
        allowed = _DATETIME_TYPES | {(state.__module__, state.__qualname__), (node.__module__, node.__qualname__)}
        if (module, name) not in allowed:
            raise RendezvousStateError(f"the stored rendezvous round holds {module}.{name}, which a rendezvous state "
                                       "never holds; the key was written by something else: delete it, or use "
                                       "another key_prefix")
        return super().find_class(module, name)


def decode(data: bytes) -> RendezvousState:
    """A state from its pickle, building nothing but the state's own types."""
    try:
        state = _StateUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise RendezvousStateError(f"the stored rendezvous round is corrupt ({exc})") from exc
    if not isinstance(state, torch_private.RendezvousState):
        raise RendezvousStateError(f"the stored rendezvous round is a {type(state).__name__}, not a rendezvous state")
    return state


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
