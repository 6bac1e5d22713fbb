"""The control-plane benchmark's short form: 8 participants on each backend form a round, the
killed one is found lost by every survivor, and the next round holds the rest; the JSON keeps its
contract. Speed is measured by the script itself (scripts/bench_control_plane.py), never here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, worker_env
from harness.etcd_server import etcd_available

NODES = 8


@pytest.mark.skipif(not etcd_available(), reason="no etcd binary (apt-get install etcd-server)")
def test_bench_control_plane_writes_its_contract(tmp_path):
    out = tmp_path / "control.json"
    done = subprocess.run([sys.executable, "scripts/bench_control_plane.py", "--nodes", str(NODES), "--backend",
                           "c10d,etcd3", "--per-process", "4", "--steady-s", "2", "--phase-timeout-s", "40",
                           "--json", str(out)],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"c10d", "etcd3"}
    for backend, by_nodes in report["results"].items():
        result = by_nodes[str(NODES)]
        assert "error" not in result, (backend, result)
        assert result["first_round_world_sizes"] == [NODES] and result["second_round_world_sizes"] == [NODES - 1]
        assert result["causes"] == ["node_lost"], (backend, result)  # killed, not "left by itself"
        assert 0 < result["detect_s"] <= result["rerendezvous_s"]
        assert 0 < result["form_s"] and 0 < result["ops_per_s"] and 0 < result["bytes_per_s"]
        assert result["peak_rss_bytes"] > 0 and result["processes"] == 3  # the victim's and 7 in two
    etcd3 = report["results"]["etcd3"][str(NODES)]
    # Leased heartbeat keys: a keep-alive is one small message, nothing is put in steady state.
    assert etcd3["mvcc_puts_per_s"] == 0, etcd3
    assert etcd3["bytes_per_s"] < report["results"]["c10d"][str(NODES)]["bytes_per_s"]
