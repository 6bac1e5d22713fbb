"""In-process recovery (elastic.in_process) end to end: real agents on 127.0.0.1 (gloo), faults
injected by the harness. Survivors keep their worker processes and heal the DDP state from the
newest step a live rank holds; a joining node's new worker heals from a peer; a node whose own
worker died restarts it (the fallback), and the round still agrees on one step."""

from __future__ import annotations

import sys

from conftest import REPO
from test_recovery_e2e import assert_trained_as_without_faults, harness_args, train_through_a_node_loss

from agent.events import read_events
from agent.recovery_timeline import recovery_after

sys.path.insert(0, str(REPO / "scripts"))
import local_cluster


def worker_pids(events: list[dict], before: float | None = None, after: float | None = None) -> dict[int, int]:
    """Each rank's worker pid, from the steps' saves it recorded in the window."""
    return {e["rank"]: e["pid"] for e in events if e["event"] in ("save_started", "first_step_done")
            and (before is None or e["time"] < before) and (after is None or e["time"] > after)}


def test_the_survivors_of_a_node_loss_keep_their_processes_and_lose_nothing(tmp_path):
    """3 -> 2 ranks in-process: the survivors' workers go on in the same processes from the step
    they held (no step lost, no restore from storage), and the job sees the same samples per step
    and ends with the same model as one rank trained without faults."""
    faulty, reference = tmp_path / "faulty", tmp_path / "reference"
    faulty.mkdir()
    killed_at = train_through_a_node_loss(faulty, in_process=True)
    events = read_events(faulty / "events.jsonl")
    recovery = recovery_after(events, killed_at, failed_at=killed_at)
    assert recovery is not None and recovery["path"] == "in_process", recovery
    assert recovery["restore_source"] == "in_process" and recovery["bytes_from_storage"] == 0, recovery
    before, after = worker_pids(events, before=killed_at), worker_pids(events, after=killed_at)
    assert set(after.values()) <= set(before.values()), (before, after)  # no new worker process
    # The last step started at 3 ranks (its samples are logged before its collectives) is the one
    # the kill struck: the survivors go on from it when one of them completed it, else from the one
    # before, the newest they all hold. Either way no completed step is lost or trained twice (below).
    last_started = max(e["step"] for e in read_events(faulty / "samples.jsonl") if e["world_size"] == 3)
    assert recovery["restored_step"] in (last_started - 1, last_started), (recovery, last_started)
    assert_trained_as_without_faults(faulty, reference)


def test_a_join_a_freeze_a_worker_crash_and_a_kill_during_the_reformation_in_process(tmp_path):
    join, freeze, crash, during = local_cluster.run_scenarios(
        harness_args(scenario="join,freeze,kill-worker,kill-during-restore", in_process=True), tmp_path)
    # The new node's worker heals from a live peer: nothing is read from storage.
    assert (join["cause"], join["world_size_after"], join["path"]) == ("node_joined", 3, "in_process"), join
    assert join["bytes_from_storage"] == 0, join
    # The frozen node's peers are blocked in a collective with it: cutting their connections frees them.
    assert (freeze["cause"], freeze["path"], freeze["world_size_after"]) == ("node_lost", "in_process", 2), freeze
    # The node whose worker died restarts it; its new worker heals from a survivor's memory.
    assert crash["path"] == "restart" and crash["fallback_reason"] == "a worker process ended", crash
    assert crash["bytes_from_storage"] == 0, crash
    # A second node killed while the survivors re-form: they leave that round too and go on alone,
    # or, where a worker cannot be freed in time, its node restarts it after the deadline.
    assert during["world_size_after"] == 1, during
    assert during["path"] == "in_process" or "elastic.in_process_deadline" in during["fallback_reason"], during
    events = read_events(tmp_path / "events.jsonl")
    fallbacks = [e["reason"] for e in events if e["event"] == "in_process_fallback"]
    assert all(r == "a worker process ended" or "elastic.in_process_deadline" in r for r in fallbacks), fallbacks
    # The joined node's and the restarted worker's state came from survivors (the others held it).
    healed = [e for e in events if e["event"] == "restore_done" and e["source"] == "peer"]
    assert len(healed) >= 2 and all(e["bytes"] > 0 for e in healed), healed
    assert {e["source"] for e in events if e["event"] == "restore_done"} <= {"peer", "in_process"}
