"""simulate_scale.py's model: each phase follows from the stated figures, and every figure is a flag."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from harness.scale_model import (  # scripts/ is on the path through conftest
    Assumptions,
    classic,
    round_after_loss,
    simulate,
    tiers,
    torchrevive,
    torchrevive_memory,
)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "simulate_scale.py"


def test_classic_reads_one_stream_and_broadcasts_it():
    a = Assumptions()
    assert classic(a)["restore"] == pytest.approx(1e12 / 0.6e9 + 1e12 / 40e9)


def test_replicated_state_read_striped_or_whole_by_every_rank():
    a = replace(Assumptions(), replicated_fraction=0.1, page_cache_warm=0.0)
    striped, whole = torchrevive(a)["restore"], torchrevive(replace(a, stripe_replicated=False))["restore"]
    nodes, start = a.nodes - 1, a.warm_fork_s + a.process_group_init_s + a.model_build_s
    per_node = min(a.client_gbps, a.storage_aggregate_gbps / nodes) * 1e9
    sharded = 0.9e12 / nodes

    def restore(own: float, exchange: float) -> float:
        """The node's bytes read, less what the prefetch read while the workers started, which
        is copied from the page cache instead."""
        read = own / per_node
        prefetched = min(read, start)
        return read - prefetched + own * (prefetched / read) / (a.memory_gbps * 1e9) + exchange

    # Striped: the replicated 100 GB read once per cluster, a stripe per node, then exchanged.
    assert striped == pytest.approx(restore(sharded + 0.1e12 / nodes, 0.1e12 / (a.nic_gbps * 1e9)))
    # Whole: each of a node's 8 ranks reads all of it, nothing to exchange: 30x longer here.
    assert whole == pytest.approx(restore(sharded + 0.1e12 * a.gpus_per_node, 0.0))
    assert whole > 30 * striped


def test_a_hang_is_found_by_the_heartbeats_and_a_kill_by_the_connection():
    a = Assumptions()
    # The last heartbeat came half an interval before the hang, on average; the watch reads the
    # state every quarter interval.
    assert torchrevive(replace(a, failure="hang"))["detect"] == pytest.approx(3 * 1.0 - 1.0 / 2 + 1.0 / 8)
    assert torchrevive(a)["detect"] == a.liveness_detect_s


def test_boolean_figures_are_flags(tmp_path):
    out = tmp_path / "model.json"
    subprocess.run([sys.executable, str(SCRIPT), "--replicated-fraction", "0.1", "--no-stripe-replicated",
                    "--json", str(out)], check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert result["assumptions"]["stripe_replicated"] is False
    expected = torchrevive(replace(Assumptions(), replicated_fraction=0.1, stripe_replicated=False))
    assert result["approaches"]["torchrevive"]["phases"]["restore"] == pytest.approx(expected["restore"])


def test_goodput_charges_each_failure_its_recovery_and_the_work_since_the_last_commit():
    a = replace(Assumptions(), mtbf_s=3600.0, checkpoint_interval_s=1800.0)
    # A synchronous save writes 1 TB at 100 GB/s (10 GB/s per node caps 64 nodes at 640): 10 s,
    # committed as it ends; training waits for all of it every half hour.
    (save,) = tiers("classic", a)
    assert (save.blocking_s, save.commit_s) == (pytest.approx(10.0), pytest.approx(10.0))
    recovery = sum(classic(a).values())
    expected = (1 - 10.0 / 1800.0) * (1 - (recovery + 900.0 + 10.0) / 3600.0)
    assert simulate(a)["approaches"]["classic"]["goodput"] == pytest.approx(expected)


def test_the_memory_tier_bounds_the_work_lost_by_its_own_interval():
    a = replace(Assumptions(), memory_interval_s=60.0)
    storage, memory = tiers("torchrevive_memory", a)
    assert storage == tiers("torchrevive", a)[0]
    # A GPU's 1.95 GB staged at 20 GB/s, then the node's 15.6 GB into tmpfs (20 GB/s) and to its
    # buddy over the NIC (40 GB/s).
    share = 1e12 / 64
    assert memory.commit_s == pytest.approx(1e12 / 512 / 20e9 + share / 20e9 + share / 40e9)
    approaches = simulate(a)["approaches"]
    assert approaches["torchrevive_memory"]["lost_work_s"] == pytest.approx(30.0 + memory.commit_s)
    assert approaches["torchrevive"]["lost_work_s"] == pytest.approx(900.0 + storage.commit_s)
    # The pull from the peers' RAM (15.9 GB at 40 GB/s) fits inside the workers' start.
    assert torchrevive_memory(a)["restore"] == pytest.approx(1e12 / 63 / 20e9)
    assert approaches["torchrevive_memory"]["goodput"] > approaches["torchrevive"]["goodput"] + 0.2


def test_torchsnapshots_staging_keeps_training_waiting_longer_by_its_measured_factor():
    a = Assumptions()
    assert tiers("parallel", a)[0].blocking_s == pytest.approx(16.9 * tiers("torchrevive", a)[0].blocking_s)


def test_the_round_after_a_loss_follows_the_measured_control_plane(tmp_path):
    measured = tmp_path / "control_plane.json"
    rows = {"8": (3.2, 3.6), "32": (3.4, 4.0), "128": (3.3, 4.7), "256": {"error": "not within 180 s"}}
    results = {n: ({"detect_s": r[0], "rerendezvous_s": r[1]} if isinstance(r, tuple) else r) for n, r in rows.items()}
    measured.write_text(json.dumps({"results": {"etcd3": results, "c10d": {"8": {"detect_s": 1, "rerendezvous_s": 90}}}}))
    fit = round_after_loss(measured, 64)
    # Rounds of 0.4, 0.6 and 1.4 s at 8, 32 and 128 nodes: 0.333 s + 8.33 ms per node (least squares).
    assert fit["per_node_s"] == pytest.approx(0.00833, abs=1e-5)
    assert fit["round_after_loss_s"] == pytest.approx(0.333 + 64 * 0.00833, abs=1e-3)
    out = tmp_path / "model.json"
    subprocess.run([sys.executable, str(SCRIPT), "--control-plane", str(measured), "--json", str(out)],
                   check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert result["approaches"]["torchrevive"]["phases"]["rendezvous"] == pytest.approx(fit["round_after_loss_s"])
    assert set(result["approaches"]) == {"classic", "parallel", "torchrevive", "torchrevive_memory"}
    one_point = tmp_path / "one.json"
    one_point.write_text(json.dumps({"results": {"etcd3": {"8": {"detect_s": 3.0, "rerendezvous_s": 3.5}}}}))
    with pytest.raises(ValueError, match="two node counts"):
        round_after_loss(one_point, 64)
