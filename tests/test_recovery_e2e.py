"""End to end: real agents on 127.0.0.1 (gloo), faults injected by the harness
(scripts/local_cluster.py), recovery read from the job's event log."""

from __future__ import annotations

import argparse
import sys

from conftest import REPO, free_port

from agent.checkpoint import committed_snapshots
from agent.events import read_events
from agent.snapshot_check import check_snapshot

sys.path.insert(0, str(REPO / "scripts"))
import local_cluster


def harness_args(**overrides) -> argparse.Namespace:
    args = dict(nodes=3, nproc_per_node=1, scenario="kill", fault_node=2, backend="c10d",
                rdzv_endpoint=f"127.0.0.1:{free_port()}", state_mb=4, interval_steps=5, timeout=120)
    args.update(overrides)
    return argparse.Namespace(**args)


def test_freeze_thaw_kill_join_and_a_worker_crash_in_a_row(tmp_path):
    runs = local_cluster.run_scenarios(harness_args(scenario="freeze,kill,join,kill-worker"), tmp_path)
    by_scenario = {run["scenario"]: run for run in runs}
    # A frozen node is dropped once its heartbeats lapse; the others go on at world size 2.
    assert by_scenario["freeze"]["cause"] == "node_lost"
    assert (by_scenario["freeze"]["world_size_before"], by_scenario["freeze"]["world_size_after"]) == (3, 2)
    # A killed node (it had rejoined after its thaw, so the world was 3 again).
    assert (by_scenario["kill"]["world_size_before"], by_scenario["kill"]["world_size_after"]) == (3, 2)
    assert by_scenario["join"]["cause"] == "node_joined" and by_scenario["join"]["world_size_after"] == 3
    assert by_scenario["kill-worker"]["cause"] == "worker_failed"
    assert by_scenario["kill-worker"]["world_size_after"] == 3
    for run in runs:  # every recovery restored a snapshot, and the phases add up to it
        assert run["restored_step"] is not None and run["restored_step"] > 0
        assert abs(sum(run["phases"].values()) - run["recovery_s"]) < 1e-6
    events = read_events(tmp_path / "events.jsonl")
    causes = [e["cause"] for e in events if e["event"] == "membership_change"]
    assert "node_hung" in causes  # the thawed node found itself out of the round
    # Only the crashed worker counted as a restart: the membership changes did not.
    assert max(e["restart"] for e in events if "restart" in e) == 1
    # Nothing committed was lost or damaged: every committed snapshot checks out.
    snapshots = committed_snapshots(tmp_path / "checkpoints")
    assert snapshots
    for _, path in snapshots:
        assert check_snapshot(path).checksummed
