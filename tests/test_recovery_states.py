"""The recovery agent's state machine, every path, without processes."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.agent.server.api import WorkerState

from agent.membership import Change
from agent.recovery_states import (
    ConfirmLoss,
    Continue,
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
