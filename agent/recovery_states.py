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
    HEALTHY --observe: nodes wait to join, a commit due within join_wait--> HEALTHY (DeferJoin)
            --observe: a commit made since, or the wait ran out--> STOPPING (Recover)

A node waiting to join is admitted at once unless the commit notice says a snapshot is due within
``join_wait_s``: then training goes on until that commit and restarts from it, losing only the
steps trained while the workers stop (a loss, a failure or the end of the job meanwhile is acted on
at once, as ever). A restart at once would throw away everything trained since the last commit (or
the round's restore); waiting only leaves the joining nodes idle until the commit. Every agent
decides alone, from its own node's notice of the same commits, so the rule depends on the notice
and not on the moment each agent saw the join (a rule that weighed the time since the commit
would let two agents that saw the join on either side of its threshold decide differently). A
join waits at most ``join_wait_s``, and at most twice as long as the commit was due in
(``LATE_COMMIT_MIN_S`` at least): a commit that does not come is not waited for.

Only a worker's own failure counts against ``max_restarts``; a restart counted for a failure that
the next round shows was caused by a membership change (peers lost or joined) is given back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch.distributed.elastic.agent.server.api import WorkerState

from agent.commit_notice import CommitNotice
from agent.membership import Change

LATE_COMMIT_MIN_S = 10.0
"""A deferred join waits at least this long for a commit due sooner (a save's time varies)."""


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
    deferred_s: float = 0.0
    """How long a join was deferred before it (training went on meanwhile)."""
    at_commit: int | None = None
    """The step whose commit ended the deferral (None: not deferred, or it timed out)."""


@dataclass(frozen=True)
class DeferJoin:
    """Nodes wait to join: keep training until the next commit, due by ``due``, or until ``until``."""

    change: Change
    due: float
    until: float


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


Action = Continue | Recover | DeferJoin | ConfirmLoss | Finish | Fail


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
        join_wait_s: how long a join may wait for a commit due by then (0: never).
        detection_skew_s: how much later than another node's agent this one may see the same
            join: a commit that close before it counts as made since (the others restart at it).
    """

    def __init__(self, max_restarts: int, *, watches_membership: bool, join_wait_s: float = 0.0,
                 detection_skew_s: float = 0.0) -> None:
        self.phase = Phase.RENDEZVOUS
        self.join_wait_s = join_wait_s
        self.detection_skew_s = detection_skew_s
        self._deferred: tuple[Change, float, float] | None = None
        """The join being deferred: its change, since when, until when."""
        self.remaining_restarts = max_restarts
        self._watches_membership = watches_membership
        self._restart_counted = False
        self._participants: frozenset[str] = frozenset()

    @property
    def deferring(self) -> bool:
        """A join waits for a commit: :meth:`observe` needs the latest commit notice."""
        return self._deferred is not None

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

    def observe(self, workers: WorkerState, change: Change | None, *, now: float,
                commit: CommitNotice | None = None) -> Action:
        """One pass of the monitor loop: the workers' state, the membership change seen, if any,
        and the latest commit this node's workers told of (``now``: seconds since the epoch, the
        clock of a worker failure's time and of the commit notice)."""
        self._expect(Phase.HEALTHY, Phase.STANDBY)
        if workers == WorkerState.SUCCEEDED:
            announce = self.phase == Phase.HEALTHY
            self.phase = Phase.SUCCEEDED
            return Finish(announce=announce)
        if change is not None and not (self._deferred is not None and change.only_joins):
            due = self._commit_due(change, now, commit) if workers == WorkerState.HEALTHY else None
            if due is None:
                return self._recover(change)
            until = now + min(self.join_wait_s, max(2 * (due - now), LATE_COMMIT_MIN_S))
            self._deferred = (change, now, until)
            action = self._deferred_join(now, commit)  # a commit made just before counts
            return action if isinstance(action, Recover) else DeferJoin(change, due=due, until=until)
        if workers == WorkerState.HEALTHY:
            return self._deferred_join(now, commit)
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

    def _commit_due(self, change: Change, now: float, commit: CommitNotice | None) -> float | None:
        """When the commit a join can wait for is due; None when it cannot wait: this node stands
        by, somebody was lost or left, or the notice says none is due within ``join_wait_s``."""
        due = commit.next_due if commit is not None else None
        if (self.phase == Phase.HEALTHY and change.only_joins and self.join_wait_s > 0
                and due is not None and due <= now + self.join_wait_s):
            return due
        return None

    def _deferred_join(self, now: float, commit: CommitNotice | None) -> Action:
        """Training goes on; a join deferred ends at a commit made since, or at its deadline."""
        if self._deferred is None:
            return Continue()
        change, since, until = self._deferred
        if commit is not None and commit.is_commit and commit.at > since - self.detection_skew_s:
            return self._recover(change, deferred_s=now - since, at_commit=commit.step)
        if now >= until:
            return self._recover(change, deferred_s=now - since)
        return Continue()

    def _recover(self, change: Change, *, counted: bool = False, deferred_s: float = 0.0,
                 at_commit: int | None = None) -> Recover:
        self.phase = Phase.STOPPING
        self._deferred = None
        return Recover(change, counted=counted, deferred_s=deferred_s, at_commit=at_commit)

    def _expect(self, *phases: Phase) -> None:
        if self.phase not in phases:
            raise RuntimeError(f"the recovery agent is {self.phase.value}, not "
                               f"{' or '.join(p.value for p in phases)}: a bug in the agent's monitor loop")
