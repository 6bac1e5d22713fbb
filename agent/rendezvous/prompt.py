"""A prompt re-rendezvous for torch.distributed.elastic's dynamic rendezvous (c10d, etcd3).

torch's rendezvous completes a round when ``max_nodes`` joined, or ``last_call_timeout`` after
``min_nodes`` did, and while a node waits it reads the shared state once a second (and its state
holder serves reads from a 1 s cache). After a membership change, the survivors therefore wait out
the last call and up to a second per step of the protocol (old round left, new round joined, round
marked complete) although every one of them is already there. And each of those steps is a
compare-and-set of the whole state by one node: every survivor leaves the old round, waits, and
joins the next, one write at a time, about three writes of an O(N) state per node.

:class:`PromptOpExecutor` runs torch's own rendezvous operations with three changes:

* once this node has been in a completed round, the first node to leave it moves the round on for
  everyone, in one write: the next round holds every participant that is not known dead and the
  nodes waiting to join (up to ``max_nodes``). A node carried into a round that way has nothing to
  leave and finds itself a participant when it rendezvouses; its membership watch sees the round
  move on (:mod:`agent.membership`). Each participant then says it is alive with a key of its own
  (:mod:`agent.rendezvous.round_acks`), and the first participant completes the round once all
  have: a re-rendezvous so costs two writes of the round, however many nodes there are (where
  heartbeats live in the round's state, c10d and etcd3's ``heartbeats=state``, each carried node
  whose heartbeat is more than half an interval old also writes one, as its keep-alive would);
* once this node has been in a completed round, a round completes as soon as every live node
  (each node with a current heartbeat in the state: survivors and joining nodes alike) is a
  participant and has said so. A node that is alive but has not said so yet is waited for, up to
  torch's last call, which leaves it out. A lost one is gone from the state once its heartbeats
  lapse, or at once when its agent's connection closed
  (:class:`~agent.rendezvous.node_ledger.NodeLedger`), which is written back at once. The first
  round of a job still waits out the last call, so that nodes starting a few seconds apart begin
  in one round;
* while waiting it re-reads the state every ``poll_interval`` instead of every second.

It also records torch's rendezvous events without walking the stack for their names.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.events.api import NodeState
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from agent import torch_private
from agent.rendezvous.node_ledger import NodeLedger
from agent.rendezvous.round_acks import RoundAcks
from agent.torch_private import (
    DistributedRendezvousOpExecutor,
    RendezvousAction,
    RendezvousContext,
    RendezvousExitOp,
    RendezvousJoinOp,
    RendezvousState,
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
        self.acks = RoundAcks(torch_private.rendezvous_store(handler), handler.settings.run_id)
        self.rejoining = False
        """Set once this node has been in a completed round, or found the job's round complete
        when it came to join: from then on rounds move on in one write and complete early."""
        self._completed_round: int | None = None
        """The last round this node completed a join in."""

    @property
    def completed_round(self) -> int | None:
        """The last round this node completed a join in (None before the first)."""
        return self._completed_round

    @classmethod
    def install(cls, handler: DynamicRendezvousHandler, *, poll_interval: float) -> PromptOpExecutor:
        """Run ``handler``'s operations through a new PromptOpExecutor (with a new
        :class:`NodeLedger` fed by the handler's syncs), and let its state holder serve a cached
        state for at most ``poll_interval`` (torch's default is 1 s)."""
        executor = cls(handler, NodeLedger.install(handler), poll_interval=poll_interval)
        torch_private.set_op_executor(handler, executor, cache_s=poll_interval)
        torch_private.record_handler_events_cheaply(handler)
        return executor

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        """torch's event of each state change, named as torch names it, for a fraction of the cost
        (see :func:`~agent.torch_private.record_rendezvous_event`)."""
        torch_private.record_rendezvous_event(self, self._node, self._settings.run_id, message, node_state)

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
            if self.ledger.take_unwritten():  # a node declared dead left this copy: drop it for everyone now
                self._state_holder.mark_dirty()
                continue
            ctx = RendezvousContext(self._node, self._state, self._settings)
            if isinstance(state_handler, RendezvousExitOp) and self._carried_over(ctx.state):
                if self._heartbeat_fresh(ctx):
                    return
                # torch's join writes the node's heartbeat, and its heartbeat timer restarts one
                # interval after the rendezvous: without a write here the gap could reach two.
                self._keep_alive()
                self._state_holder.mark_dirty()
                continue
            action = state_handler(ctx, deadline)
            if isinstance(state_handler, RendezvousJoinOp):
                self.rejoining |= ctx.state.complete  # the job is past its first round: a new node too
                full = len(ctx.state.participants) >= self._settings.max_nodes
                if action == RendezvousAction.ADD_TO_PARTICIPANTS and full:
                    # A round moved on is open while its participants say they are alive: torch,
                    # whose rounds complete as soon as they are full, would add this one more.
                    action = RendezvousAction.ADD_TO_REDUNDANCY_LIST
            if isinstance(state_handler, RendezvousExitOp) and self._may_move_on(ctx, action):
                self._move_round_on()
                self._state_holder.mark_dirty()
                continue
            if isinstance(state_handler, RendezvousJoinOp):
                self._acknowledge(ctx.state)
                if self._may_complete_now(ctx, action):
                    action = RendezvousAction.MARK_RENDEZVOUS_COMPLETE
                elif action == RendezvousAction.MARK_RENDEZVOUS_COMPLETE and self._leave_out_silent(ctx.state):
                    self._state_holder.mark_dirty()
                    continue
            if action == RendezvousAction.FINISH:
                if isinstance(state_handler, RendezvousJoinOp) and self._node in self._state.participants:
                    self._completed_round = self._state.round
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

    def _carried_over(self, state: RendezvousState) -> bool:
        """Whether a peer already moved the round on past the one this node completed, carrying
        this node into it: there is nothing to leave."""
        return (self.rejoining and self._completed_round is not None and state.round > self._completed_round
                and self._node in state.participants)

    def _heartbeat_fresh(self, ctx: RendezvousContext) -> bool:
        """Whether this node's heartbeat in the state is less than half a keep-alive interval old."""
        beat = ctx.state.last_heartbeats.get(self._node)
        return beat is not None and datetime.now(timezone.utc) - beat < ctx.settings.keep_alive_interval / 2

    def _may_move_on(self, ctx: RendezvousContext, action: RendezvousAction) -> bool:
        """Whether this node, about to leave the completed round it was in, moves the round on for
        everyone instead."""
        state = ctx.state
        return (self.rejoining and action == RendezvousAction.REMOVE_FROM_PARTICIPANTS and state.complete
                and not state.closed and state.round == self._completed_round)

    def _move_round_on(self) -> None:
        """The next round, in this node's copy of the state: every participant not known dead, then
        the nodes waiting to join and the spares, up to ``max_nodes`` (the others are spares, on
        torch's redundancy list); open until every one of them said it is alive, or until torch's
        last call."""
        state, settings = self._state, self._settings
        live = {node for node in state.last_heartbeats if not self.ledger.is_dead(str(node))}
        staying = [node for node in state.participants if node in live]
        waiting = sorted((state.wait_list | state.redundancy_list) & live)
        joining = waiting[:max(0, settings.max_nodes - len(staying))]
        now = datetime.now(timezone.utc)
        state.round += 1
        state.last_heartbeats[self._node] = now
        state.participants = {node: 0 for node in [*staying, *joining]}
        state.wait_list -= set(waiting)
        state.redundancy_list = set(waiting[len(joining):])  # no room: spares, as torch keeps them
        state.complete = False
        state.deadline = now + settings.timeout.last_call if len(state.participants) >= settings.min_nodes else None

    def _acknowledge(self, state: RendezvousState) -> None:
        """Say that this node is alive in the round it waits in as a participant (once a round, as
        :meth:`RoundAcks.ack` keeps it; a new node too, carried in from the wait list)."""
        if self._node in state.participants and not state.complete:
            self.acks.ack(state.round, str(self._node))

    def _leave_out_silent(self, state: RendezvousState) -> bool:
        """At torch's last call, drop from this node's copy of the round the participants that never
        said they are alive (carried over dead, most likely; a live one rejoins through the wait
        list, as a node too late for torch's last call does). Whether any was dropped."""
        if not self.rejoining:
            return False
        names = {str(node): node for node in state.participants}
        silent = names.keys() - self.acks.acked(state.round, names)
        for name in silent:
            del state.participants[names[name]]
        if silent and len(state.participants) < self._settings.min_nodes:
            state.deadline = None
        return bool(silent)

    def _may_complete_now(self, ctx: RendezvousContext, action: RendezvousAction) -> bool:
        """Whether this round can complete now rather than at torch's last call: the job is past its
        first round, every live node participates, every participant said it is alive, and this
        node is the first participant (by name)."""
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
        # A node of the previous round missing here was left behind as dead by the node that moved
        # the round on: nobody leaves a round by itself. The first participant completes the round
        # (the others wait), once every participant said it is alive: one read, by one node.
        joined = {str(node) for node in participants}
        return min(joined) == str(ctx.node) and self.acks.acked(state.round, joined) == joined
