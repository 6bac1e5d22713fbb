"""The keys a rendezvous round leaves in the store, and their deletion once a later round formed.

Each completed round writes keys under its own prefix of the rendezvous store (torch's
``torch.rendezvous.<run_id>.<round>``): torch's rank assignment and bootstrap address, its
leader's workers' store and restore choice, each agent's liveness address; and each node
acknowledges the round it joins (:mod:`agent.rendezvous.round_acks`). Nothing reads them once a
later round formed, and none expires by itself (etcd's keys hang on the agents' lease, which lives
as long as any agent does): without deletion the store grows every round. One node deletes a
finished round's keys: the first, by name, of its participants that are in the new round, so a
round whose leader died is cleaned too. A node of the old round left out of the new one (frozen,
then thawed) may still be reading them: it is fenced; its reads of torchrevive's keys notice that
the round moved on and rejoin instead of waiting for a deleted key
(:func:`agent.rendezvous.round_values.wait_for_value`), while torch's own reads of the old round
wait for the store's timeout before the agent rejoins.

The memory tier deletes its own keys (:mod:`agent.memory.tier`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from agent import torch_private
from agent.liveness import ADDRESS_KEY
from agent.rendezvous.round_acks import RoundAcks

WORKER_STORE_KEY = "torchrevive/worker_store"
"""The workers' store of the round (``host port``), set by its leader."""
RESTORE_FROM_KEY = "torchrevive/restore_from"
"""The snapshot the round restores, set by its leader (see :mod:`agent.rendezvous.round_values`)."""


@dataclass(frozen=True)
class FinishedRound:
    """A round this node ran in, whose keys go once a later round formed."""

    round: int
    participants: frozenset[str]

    def deleted_by(self, participants: frozenset[str]) -> str | None:
        """The node of a later round (of ``participants``) that deletes this round's keys."""
        return min(self.participants & participants, default=None)

    def keys(self) -> list[str]:
        """This round's keys in its store (the memory tier's aside)."""
        liveness = [ADDRESS_KEY.format(node=node) for node in sorted(self.participants)]
        return [*torch_private.torch_round_keys(len(self.participants)), WORKER_STORE_KEY, RESTORE_FROM_KEY, *liveness]


def delete_keys(handler: DynamicRendezvousHandler, acks: RoundAcks, finished: FinishedRound) -> None:
    """Delete ``finished``'s keys and its participants' acknowledgments of it."""
    store = torch_private.rendezvous_store(handler)
    keys = [torch_private.round_key(handler, finished.round, key) for key in finished.keys()]
    keys += acks.keys(finished.round, sorted(finished.participants))
    delete_many = getattr(store, "delete_keys", None)
    if delete_many is not None:  # etcd3: a few transactions rather than a request a key
        delete_many(keys)
        return
    for key in keys:
        store.delete_key(key)
