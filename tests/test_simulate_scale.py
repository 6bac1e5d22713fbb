"""simulate_scale.py's model: each phase follows from the stated figures, and every figure is a flag."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from simulate_scale import Assumptions, classic, torchrevive  # scripts/ is on the path through conftest

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
