"""A prompt re-rendezvous for torch.distributed.elastic's dynamic rendezvous (c10d, etcd3).

torch's rendezvous completes a round when ``max_nodes`` joined, or ``last_call_timeout`` after
``min_nodes`` did, and while a node waits it reads the shared state once a second (and its state
holder serves reads from a 1 s cache). After a membership change, the survivors therefore wait out
the last call and up to a second per step of the protocol (old round left, new round joined, round
marked complete) although every one of them is already there.

:class:`PromptOpExecutor` runs torch's own rendezvous operations with two changes:

* once this node has been in a completed round, a round completes as soon as every live node
  (each node with a current heartbeat in the state: survivors and joining nodes alike) is a
  participant, and so is every node of the previous round that is not known dead. A node that is
  alive but has not joined yet is waited for, up to torch's last call: also one of the previous
  round caught between leaving it and joining the next, when the state holds no heartbeat of it.
  A lost one is gone from the state once its heartbeats lapse, or at once when its agent's
  connection closed (:class:`~agent.rendezvous.node_ledger.NodeLedger`). The first round of a job
  still waits out the last call, so that nodes starting a few seconds apart begin in one round;
* while waiting it re-reads the state every ``poll_interval`` instead of every second.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from agent import torch_private
from agent.rendezvous.node_ledger import NodeLedger
from agent.torch_private import (
    DistributedRendezvousOpExecutor,
    RendezvousAction,
    RendezvousContext,
    RendezvousJoinOp,
)

_STATE_CHANGES = {
    RendezvousAction.KEEP_ALIVE: "_keep_alive",
    RendezvousAction.ADD_TO_PARTICIPANTS: "_add_to_participants",
    RendezvousAction.ADD_TO_WAIT_LIST: "_add_to_wait_list",
    RendezvousAction.ADD_TO_REDUNDANCY_LIST: "_add_to_redundancy_list",
    RendezvousAction.REMOVE_FROM_PARTICIPANTS: "_remove_from_participants",
    RendezvousAction.REMOVE_FROM_WAIT_LIST: "_remove_from_wait_list",
    RendezvousAction.REMOVE_FROM_REDUNDANCY_LIST: "_remove_from_redundancy_list",
    RendezvousAction.MARK_RENDEZVOUS_COMPLETE: "_mark_rendezvous_complete",
    RendezvousAction.MARK_RENDEZVOUS_CLOSED: "_mark_rendezvous_closed",
}
"""torch's executor's own state changes, by the action that asks for each."""


class PromptOpExecutor(DistributedRendezvousOpExecutor):
    """torch's distributed rendezvous executor, completing re-rendezvous rounds as soon as every
    live node joined and polling every ``poll_interval`` while it waits.

    Args:
        handler: the handler whose operations it runs; :meth:`install` puts it in place.
        ledger: the liveness of the nodes, fed by every sync of the handler's state.
        poll_interval: seconds between two reads of the shared state while waiting.
    """

    def __init__(self, handler: DynamicRendezvousHandler, ledger: NodeLedger, *, poll_interval: float) -> None:
        super().__init__(*torch_private.executor_parts(handler))
        self.poll_interval = poll_interval
        self.ledger = ledger
        self.rejoining = False
        """Set once this node has been in a completed round: from then on rounds complete early."""
        self._previous_round: frozenset[str] = frozenset()
        """The participants of the last round this node completed a join in."""

    @classmethod
    def install(cls, handler: DynamicRendezvousHandler, *, poll_interval: float) -> PromptOpExecutor:
        """Run ``handler``'s operations through a new PromptOpExecutor (with a new
        :class:`NodeLedger` fed by the handler's syncs), and let its state holder serve a cached
        state for at most ``poll_interval`` (torch's default is 1 s)."""
        executor = cls(handler, NodeLedger.install(handler), poll_interval=poll_interval)
        torch_private.set_op_executor(handler, executor, cache_s=poll_interval)
        return executor

    def run(
        self,
        state_handler: Callable[[RendezvousContext, float], RendezvousAction],
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        """Run ``state_handler`` (a torch rendezvous operation) until it finishes."""
        action = None
        while action != RendezvousAction.FINISH:
            self._state_holder.sync()
            self._state = self._state_holder.state
            ctx = RendezvousContext(self._node, self._state, self._settings)
            action = state_handler(ctx, deadline)
            if isinstance(state_handler, RendezvousJoinOp) and self._may_complete_now(ctx, action):
                action = RendezvousAction.MARK_RENDEZVOUS_COMPLETE
            if action == RendezvousAction.FINISH:
                if isinstance(state_handler, RendezvousJoinOp) and self._node in self._state.participants:
                    self._previous_round = frozenset(str(node) for node in self._state.participants)
                continue
            if action == RendezvousAction.ERROR_CLOSED:
                raise RendezvousClosedError
            if action == RendezvousAction.ERROR_TIMEOUT:
                raise RendezvousTimeoutError
            if action == RendezvousAction.SYNC:
                time.sleep(self.poll_interval)
                continue
            getattr(self, _STATE_CHANGES[action])()
            if action == RendezvousAction.REMOVE_FROM_REDUNDANCY_LIST and update_deadline:
                deadline = update_deadline(self._settings.timeout.join)
            self._state_holder.mark_dirty()

    def _may_complete_now(self, ctx: RendezvousContext, action: RendezvousAction) -> bool:
        """Whether this round can complete now rather than at torch's last call: this node (which
        was in a completed round before) waits as a participant, and every live node participates."""
        if not self.rejoining or action != RendezvousAction.SYNC:
            return False
        state = ctx.state
        participants = state.participants
        if state.complete or state.closed or ctx.node not in participants:
            return False
        if not ctx.settings.min_nodes <= len(participants) <= ctx.settings.max_nodes:
            return False
        live = set(state.last_heartbeats) - state.redundancy_list
        if not live <= participants.keys():
            return False
        joined = {str(node) for node in participants}
        return all(self.ledger.is_dead(node) for node in self._previous_round - joined)
