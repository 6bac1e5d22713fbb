"""The recovery agent's decisions as one state machine: pure (no processes, no I/O, no clock), so
that every path through it is unit-tested.

The agent's monitor loop only gathers observations (the workers' state from torch, a membership
change from the watch, the participants of a round just formed) and carries out the action the
machine returns, as torch's own elastic agent is driven by ``WorkerState``::

    RENDEZVOUS --round_formed--> HEALTHY | STANDBY
    HEALTHY | STANDBY --observe: workers succeeded--> SUCCEEDED            (Finish)
                      --observe: a membership change--> STOPPING           (Recover)
                      --observe: a worker failed, a restart left--> STOPPING (Recover, counted)
                      --observe: a worker failed, none left--> CONFIRMING_LOSS (ConfirmLoss)
                                                       or FAILED            (Fail: no watch)
    CONFIRMING_LOSS --loss_confirmed: a peer was lost--> STOPPING          (Recover)
                    --loss_confirmed: none--> FAILED                       (Fail)
    STOPPING --workers_stopped--> RENDEZVOUS

Only a worker's own failure counts against ``max_restarts``; a restart counted for a failure that
the next round shows was caused by a membership change (peers lost or joined) is given back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch.distributed.elastic.agent.server.api import WorkerState

from agent.membership import Change


class Phase(enum.Enum):
    RENDEZVOUS = "rendezvous"
    """Forming the next round (the first one too)."""
    HEALTHY = "healthy"
    """This node's workers run in the round."""
    STANDBY = "standby"
    """This node is in the round but offers no workers (beyond ``world_size_multiple_of``)."""
    CONFIRMING_LOSS = "confirming_loss"
    """Workers failed with no restart left: waiting to see whether a lost peer caused it."""
    STOPPING = "stopping"
    """Stopping the workers for a recovery."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class Continue:
    """Nothing to do: keep monitoring."""


@dataclass(frozen=True)
class Recover:
    """Stop the workers, then form the next round."""

    change: Change
    counted: bool = False
    """The recovery used up one of ``max_restarts`` (a worker's own failure)."""


@dataclass(frozen=True)
class ConfirmLoss:
    """Watch the membership up to the heartbeat timeout for a lost peer behind the workers'
    failure, then call :meth:`RecoveryMachine.loss_confirmed`."""


@dataclass(frozen=True)
class Finish:
    """The job succeeded: join the exit barrier."""

    announce: bool
    """Tell standby nodes the job is over (a training node does; a standby one has nothing to tell)."""


@dataclass(frozen=True)
class Fail:
    """Stop the workers; the agent fails with torch's error summary."""


Action = Continue | Recover | ConfirmLoss | Finish | Fail


@dataclass(frozen=True)
class RoundOutcome:
    """What a round just formed changed, as this agent sees it."""

    lost: frozenset[str]
    joined: frozenset[str]
    refunded: bool
    """A restart counted for the last recovery was given back: the membership changed."""


class RecoveryMachine:
    """The agent's phase, its remaining restarts, and the transitions between them.

    Args:
        max_restarts: how many of its own worker failures the node survives.
        watches_membership: whether membership changes can be observed (a dynamic rendezvous:
            c10d, etcd3); without it a failure with no restart left fails the agent at once.
    """

    def __init__(self, max_restarts: int, *, watches_membership: bool) -> None:
        self.phase = Phase.RENDEZVOUS
        self.remaining_restarts = max_restarts
        self._watches_membership = watches_membership
        self._restart_counted = False
        self._participants: frozenset[str] = frozenset()

    def round_formed(self, participants: frozenset[str], *, standby: bool) -> RoundOutcome:
        """A rendezvous completed with ``participants``; this node trains or stands by."""
        self._expect(Phase.RENDEZVOUS)
        previous = self._participants
        lost, joined = previous - participants, participants - previous
        refunded = bool(previous and (lost or joined) and self._restart_counted)
        if refunded:
            self.remaining_restarts += 1
        self._restart_counted = False
        self._participants = participants
        self.phase = Phase.STANDBY if standby else Phase.HEALTHY
        return RoundOutcome(lost=lost, joined=joined if previous else frozenset(), refunded=refunded)

    def observe(self, workers: WorkerState, change: Change | None, *, now: float) -> Action:
        """One pass of the monitor loop: the workers' state and the membership change seen, if any
        (``now``: seconds since the epoch, for a worker failure's time)."""
        self._expect(Phase.HEALTHY, Phase.STANDBY)
        if workers == WorkerState.SUCCEEDED:
            announce = self.phase == Phase.HEALTHY
            self.phase = Phase.SUCCEEDED
            return Finish(announce=announce)
        if change is not None:
            return self._recover(change)
        if workers == WorkerState.HEALTHY:
            return Continue()
        if self.remaining_restarts <= 0 and self._watches_membership:
            self.phase = Phase.CONFIRMING_LOSS
            return ConfirmLoss()
        return self._own_failure(now)

    def loss_confirmed(self, change: Change | None, *, now: float) -> Action:
        """The outcome of :class:`ConfirmLoss`: the lost peer's change, or None."""
        self._expect(Phase.CONFIRMING_LOSS)
        return self._recover(change) if change is not None else self._own_failure(now)

    def workers_stopped(self) -> None:
        """The workers of the round are stopped: the next rendezvous starts."""
        self._expect(Phase.STOPPING)
        self.phase = Phase.RENDEZVOUS

    def _own_failure(self, now: float) -> Action:
        if self.remaining_restarts <= 0:
            self.phase = Phase.FAILED
            return Fail()
        self.remaining_restarts -= 1
        self._restart_counted = True
        return self._recover(Change("worker_failed", failed_at=now), counted=True)

    def _recover(self, change: Change, *, counted: bool = False) -> Recover:
        self.phase = Phase.STOPPING
        return Recover(change, counted=counted)

    def _expect(self, *phases: Phase) -> None:
        if self.phase not in phases:
            raise RuntimeError(f"the recovery agent is {self.phase.value}, not "
                               f"{' or '.join(p.value for p in phases)}: a bug in the agent's monitor loop")
