"""Each node's word that it is alive and in a round that a peer moved on for it.

A round moved on in one write (:mod:`agent.rendezvous.prompt`) lists nodes that have not said
anything since: one of them may have died a moment before, unseen yet by the node that moved the
round on (its own workers failed first, say). torch's protocol has every node join by itself, which
proves it alive, in a compare-and-set of the whole state, one node at a time. Here each node says so
with a key of its own in the rendezvous store, written without a compare-and-set, all nodes at
once; the round completes once every participant has. A dead node never does, and leaves the round
when its heartbeats lapse or its connection closes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

PREFIX = "torchrevive/round_acks"


class RoundAcks:
    """The acknowledgments of the rounds of one rendezvous, in its store.

    Args:
        store: the rendezvous store (c10d's TCPStore, or etcd3's store, which lists a prefix in one
            read).
        run_id: the rendezvous' run id.
    """

    def __init__(self, store: Any, run_id: str) -> None:
        self._store = store
        self._run_id = run_id
        self._last_acked: str | None = None
        """The key of this process's previous acknowledgment: gone with the next one."""

    def ack(self, round: int, node: str) -> None:
        """``node`` is alive and a participant of ``round`` (once: again is a no-op); its
        acknowledgment of an earlier round (the last one made here) goes, so the store holds one key
        per node."""
        key = self._key(round, node)
        if key == self._last_acked:
            return
        self._store.set(key, b"1")
        if self._last_acked is not None:
            self._store.delete_key(self._last_acked)
        self._last_acked = key

    def keys(self, round: int, nodes: Iterable[str]) -> list[str]:
        """The keys of ``nodes``' acknowledgments of ``round`` in the store (to delete them once a
        later round formed: none is read again)."""
        return [self._key(round, node) for node in nodes]

    def acked(self, round: int, nodes: Iterable[str]) -> set[str]:
        """Those of ``nodes`` that acknowledged ``round``."""
        nodes = set(nodes)
        list_under = getattr(self._store, "keys_under", None)
        if list_under is not None:  # etcd3: one range read
            prefix = self._key(round, "")
            return nodes & {key[len(prefix):] for key in list_under(prefix)}
        return {node for node in nodes if self._store.check([self._key(round, node)])}

    def _key(self, round: int, node: str) -> str:
        return f"{PREFIX}/{self._run_id}/{round}/{node}"
