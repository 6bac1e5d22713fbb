"""The recovery agent's state machine, every path, without processes."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.agent.server.api import WorkerState

from agent.commit_notice import RESTORE_TIER, CommitNotice
from agent.membership import Change
from agent.recovery_states import (
    ConfirmLoss,
    Continue,
    DeferJoin,
    Fail,
    Finish,
    Phase,
    RecoveryMachine,
    Recover,
)

ABC = frozenset({"a", "b", "c"})
LOST = Change("node_lost", lost=frozenset({"c"}), failed_at=5.0)


def running(max_restarts: int = 1, *, watches_membership: bool = True, standby: bool = False) -> RecoveryMachine:
    machine = RecoveryMachine(max_restarts, watches_membership=watches_membership)
    outcome = machine.round_formed(ABC, standby=standby)
    assert outcome.lost == outcome.joined == frozenset() and not outcome.refunded  # nothing before the first
    return machine


def test_healthy_workers_and_no_change_keep_the_round():
    machine = running()
    assert machine.observe(WorkerState.HEALTHY, None, now=1.0) == Continue()
    assert machine.phase == Phase.HEALTHY


def test_a_membership_change_stops_the_workers_and_forms_the_next_round_without_a_restart():
    machine = running(max_restarts=0)
    assert machine.observe(WorkerState.HEALTHY, LOST, now=6.0) == Recover(LOST, counted=False)
    assert machine.phase == Phase.STOPPING
    machine.workers_stopped()
    assert machine.phase == Phase.RENDEZVOUS
    outcome = machine.round_formed(frozenset({"a", "b"}), standby=False)
    assert outcome.lost == {"c"} and outcome.joined == frozenset() and not outcome.refunded
    assert machine.remaining_restarts == 0 and machine.phase == Phase.HEALTHY


def test_a_workers_own_failure_counts_a_restart():
    machine = running(max_restarts=1)
    action = machine.observe(WorkerState.FAILED, None, now=7.0)
    assert action == Recover(Change("worker_failed", failed_at=7.0), counted=True)
    assert machine.remaining_restarts == 0
    machine.workers_stopped()
    assert not machine.round_formed(ABC, standby=False).refunded  # the same nodes: it was its own
    assert machine.remaining_restarts == 0


def test_a_restart_counted_for_a_failure_a_membership_change_caused_is_given_back():
    machine = running(max_restarts=1)
    machine.observe(WorkerState.UNHEALTHY, None, now=7.0)  # a peer died; its heartbeat had not lapsed yet
    machine.workers_stopped()
    outcome = machine.round_formed(frozenset({"a", "b"}), standby=False)
    assert outcome.refunded and outcome.lost == {"c"} and machine.remaining_restarts == 1


def test_with_no_restart_left_a_failure_waits_to_see_a_lost_peer_behind_it():
    machine = running(max_restarts=0)
    assert machine.observe(WorkerState.FAILED, None, now=7.0) == ConfirmLoss()
    assert machine.phase == Phase.CONFIRMING_LOSS
    assert machine.loss_confirmed(LOST, now=8.0) == Recover(LOST, counted=False)
    assert machine.remaining_restarts == 0


def test_with_no_restart_left_and_no_lost_peer_the_agent_fails():
    machine = running(max_restarts=0)
    machine.observe(WorkerState.FAILED, None, now=7.0)
    assert machine.loss_confirmed(None, now=10.0) == Fail()
    assert machine.phase == Phase.FAILED


def test_without_a_membership_watch_no_restart_left_fails_at_once():
    machine = running(max_restarts=0, watches_membership=False)
    assert machine.observe(WorkerState.FAILED, None, now=7.0) == Fail()


def test_a_training_node_announces_success_and_a_standby_node_does_not():
    assert running().observe(WorkerState.SUCCEEDED, None, now=1.0) == Finish(announce=True)
    standby = running(standby=True)
    assert standby.phase == Phase.STANDBY
    assert standby.observe(WorkerState.SUCCEEDED, None, now=1.0) == Finish(announce=False)


def test_a_standby_node_takes_part_in_a_membership_change():
    machine = running(standby=True)
    assert machine.observe(WorkerState.HEALTHY, LOST, now=6.0) == Recover(LOST)
    machine.workers_stopped()
    machine.round_formed(frozenset({"a", "b"}), standby=False)
    assert machine.phase == Phase.HEALTHY


def test_a_joining_node_is_reported_once_the_first_round_is_behind():
    machine = running()
    machine.observe(WorkerState.HEALTHY, Change("node_joined", joined=frozenset({"d"})), now=2.0)
    machine.workers_stopped()
    outcome = machine.round_formed(ABC | {"d"}, standby=False)
    assert outcome.joined == {"d"} and outcome.lost == frozenset()


JOIN = Change("node_joined", joined=frozenset({"d"}))
EVERY_10_S = CommitNotice(step=40, tier="memory", at=100.0, previous_at=90.0)  # the next is due at 110


def deferring(join_wait_s: float = 30.0, *, at: float = 107.0) -> RecoveryMachine:
    """A join seen at ``at``, 3 s before the next commit is due."""
    machine = RecoveryMachine(1, watches_membership=True, join_wait_s=join_wait_s)
    machine.round_formed(ABC, standby=False)
    action = machine.observe(WorkerState.HEALTHY, JOIN, now=at, commit=EVERY_10_S)
    # It waits at most join_wait, and at most twice as long as the commit was due in (10 s at least).
    assert action == DeferJoin(JOIN, due=110.0, until=at + min(join_wait_s, max(2 * (110.0 - at), 10.0)))
    return machine


def test_a_join_waits_for_the_next_commit_and_restarts_from_it():
    machine = deferring()
    assert machine.observe(WorkerState.HEALTHY, None, now=108.0, commit=EVERY_10_S) == Continue()
    assert machine.observe(WorkerState.HEALTHY, JOIN, now=108.5, commit=EVERY_10_S) == Continue()  # seen again
    assert machine.phase == Phase.HEALTHY and machine.deferring  # the agent reads the notice on each pass
    committed = CommitNotice(step=50, tier="memory", at=110.2, previous_at=100.0)
    assert machine.observe(WorkerState.HEALTHY, None, now=110.3, commit=committed) == \
        Recover(JOIN, deferred_s=pytest.approx(3.3), at_commit=50)
    assert machine.phase == Phase.STOPPING and not machine.deferring


def test_a_rounds_restore_is_no_commit_to_end_a_wait():
    machine = deferring()
    restored = CommitNotice(step=40, tier=RESTORE_TIER, at=108.0, previous_at=None)
    assert machine.observe(WorkerState.HEALTHY, None, now=108.1, commit=restored) == Continue()


def test_a_commit_made_just_before_this_node_saw_the_join_counts_as_the_joins():
    # Another node saw the join earlier and restarts at this commit: this one does too, at once.
    machine = RecoveryMachine(1, watches_membership=True, join_wait_s=30.0, detection_skew_s=0.5)
    machine.round_formed(ABC, standby=False)
    every_half_s = CommitNotice(step=40, tier="memory", at=100.0, previous_at=99.5)  # the next is due at 100.5
    assert machine.observe(WorkerState.HEALTHY, JOIN, now=100.3, commit=every_half_s) == \
        Recover(JOIN, deferred_s=0.0, at_commit=40)


def test_a_join_waits_no_longer_than_join_wait():
    machine = deferring(join_wait_s=5.0)
    assert machine.observe(WorkerState.HEALTHY, None, now=111.9, commit=EVERY_10_S) == Continue()  # the save is late
    assert machine.observe(WorkerState.HEALTHY, None, now=112.0, commit=EVERY_10_S) == \
        Recover(JOIN, deferred_s=pytest.approx(5.0), at_commit=None)


def test_a_join_waits_no_longer_than_twice_the_time_the_commit_was_due_in():
    machine = deferring(join_wait_s=285.0)  # torch's default join_timeout leaves that much
    assert machine.observe(WorkerState.HEALTHY, None, now=116.9, commit=EVERY_10_S) == Continue()
    assert machine.observe(WorkerState.HEALTHY, None, now=117.0, commit=EVERY_10_S) == \
        Recover(JOIN, deferred_s=pytest.approx(10.0), at_commit=None)


PACED = CommitNotice(step=50, tier="storage", at=100.0, previous_at=None, step_s=1.6, interval_steps=50)
"""The first commit of a job that steps every 1.6 s and commits every 50 steps: the next is due at 180."""


@pytest.mark.parametrize("notice", [PACED, CommitNotice(step=50, tier=RESTORE_TIER, at=100.0, previous_at=None,
                                                        step_s=1.6, interval_steps=50)])
def test_the_pace_tells_when_the_next_commit_is_due_after_one_commit_or_a_restore(notice):
    # A round that went back to step 50 commits step 100 an interval after its restore: the join
    # waits for that commit, where without the pace it would restart at once and throw away the
    # steps since the restore.
    machine = RecoveryMachine(1, watches_membership=True, join_wait_s=285.0)
    machine.round_formed(ABC, standby=False)
    assert machine.observe(WorkerState.HEALTHY, JOIN, now=130.0, commit=notice) == \
        DeferJoin(JOIN, due=180.0, until=230.0)
    committed = CommitNotice(step=100, tier="storage", at=181.0, previous_at=100.0, step_s=1.6, interval_steps=50)
    assert machine.observe(WorkerState.HEALTHY, None, now=181.2, commit=committed) == \
        Recover(JOIN, deferred_s=pytest.approx(51.2), at_commit=100)


@pytest.mark.parametrize("commit, join_wait_s", [
    (None, 30.0),  # no commit yet: none is known to be due
    (CommitNotice(step=40, tier="storage", at=100.0, previous_at=None), 30.0),  # one commit, no pace: no interval
    (CommitNotice(step=40, tier="storage", at=100.0, previous_at=40.0), 30.0),  # the next is due at 160
    (EVERY_10_S, 0.0),  # deferral off
])
def test_a_join_is_admitted_at_once_when_no_commit_is_due_within_join_wait(commit, join_wait_s):
    machine = RecoveryMachine(1, watches_membership=True, join_wait_s=join_wait_s)
    machine.round_formed(ABC, standby=False)
    assert machine.observe(WorkerState.HEALTHY, JOIN, now=107.0, commit=commit) == Recover(JOIN)


@pytest.mark.parametrize("change", [
    Change("node_joined", joined=frozenset({"c"}), left=frozenset({"c"})),  # a peer's workers are gone
    Change("node_lost", lost=frozenset({"c"}), joined=frozenset({"d"})),
])
def test_a_join_with_a_peer_gone_is_not_deferred(change):
    machine = RecoveryMachine(1, watches_membership=True, join_wait_s=30.0)
    machine.round_formed(ABC, standby=False)
    assert machine.observe(WorkerState.HEALTHY, change, now=107.0, commit=EVERY_10_S) == Recover(change)


def test_a_standby_node_does_not_defer_a_join():
    machine = RecoveryMachine(1, watches_membership=True, join_wait_s=30.0)
    machine.round_formed(ABC, standby=True)
    assert machine.observe(WorkerState.HEALTHY, JOIN, now=107.0, commit=EVERY_10_S) == Recover(JOIN)


def test_a_loss_or_a_failure_while_a_join_waits_is_acted_on_at_once():
    machine = deferring()
    assert machine.observe(WorkerState.HEALTHY, LOST, now=108.0, commit=EVERY_10_S) == Recover(LOST)
    machine = deferring()
    assert machine.observe(WorkerState.FAILED, None, now=108.0, commit=EVERY_10_S) == \
        Recover(Change("worker_failed", failed_at=108.0), counted=True)
    machine.workers_stopped()
    machine.round_formed(ABC | {"d"}, standby=False)  # the next round: nothing deferred is left
    assert machine.observe(WorkerState.HEALTHY, None, now=200.0, commit=EVERY_10_S) == Continue()


def test_the_end_of_the_job_while_a_join_waits_finishes_it():
    machine = deferring()
    assert machine.observe(WorkerState.SUCCEEDED, None, now=108.0, commit=EVERY_10_S) == Finish(announce=True)


@pytest.mark.parametrize("step", ["observe", "loss_confirmed", "workers_stopped"])
def test_an_observation_out_of_turn_is_a_bug_that_says_so(step):
    machine = RecoveryMachine(1, watches_membership=True)  # still in its first rendezvous
    calls = {"observe": lambda: machine.observe(WorkerState.HEALTHY, None, now=1.0),
             "loss_confirmed": lambda: machine.loss_confirmed(None, now=1.0),
             "workers_stopped": machine.workers_stopped}
    with pytest.raises(RuntimeError, match="rendezvous"):
        calls[step]()
    machine.round_formed(ABC, standby=False)
    with pytest.raises(RuntimeError, match="healthy, not rendezvous"):
        machine.round_formed(ABC, standby=False)


def test_a_change_loses_nobody_when_nodes_only_join_seen_directly_or_from_a_peer():
    """In-process, such a change lets the step in flight finish; any other cuts the round at once."""
    assert Change("node_joined", joined=frozenset({"new"})).loses_nobody
    assert Change("round_advanced", joined=frozenset({"new"})).loses_nobody  # a peer moved the round on for it
    assert not Change("round_advanced").loses_nobody  # for a failed worker of a peer's own
    assert not Change("node_joined", joined=frozenset({"back"}), left=frozenset({"back"})).loses_nobody
    assert not Change("node_lost", lost=frozenset({"gone"})).loses_nobody
    assert not Change("node_hung", lost=frozenset({"me"})).loses_nobody
