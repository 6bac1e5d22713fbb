"""Nodes in network namespaces of their own (scripts/local_cluster.py --netns, scripts/harness/netns.py):
each agent and its workers bind and advertise their own address, and network faults (a cut link,
a slow link) are survived. Needs root and `ip netns` (CI runs as root); skipped otherwise."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import REPO, worker_env

sys.path.insert(0, str(REPO / "scripts"))
from harness import netns
from harness.ports import free_port
from harness.scenarios import run_scenarios

from agent.checkpoint.dirs import committed_snapshots
from agent.checkpoint.verify import check_snapshot
from agent.events import read_events

UNAVAILABLE = netns.unavailable_reason()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespaces: {UNAVAILABLE}")


def our_names(pid: int) -> list[str]:
    """Namespaces and links named for the run of process ``pid``."""
    listed = netns.ip("netns", "list").stdout + netns.ip("-o", "link", "show").stdout
    return sorted({word.split("@")[0].rstrip(":") for word in listed.split()
                   if (match := netns.NAME.match(word.split("@")[0].rstrip(":"))) and int(match.group(1)) == pid})


def test_each_node_has_its_address_and_the_store_host_knows_itself():
    with netns.Network(2) as network:
        assert network.addresses == ["198.18.0.1", "198.18.0.2"]
        probe = ("from agent import torch_private as t; "
                 "print(t.hosts_c10d_store('198.18.0.1'), t.hosts_c10d_store('198.18.0.2'))")
        answers = [subprocess.run(network.wrap(i, [sys.executable, "-c", probe]), env=worker_env(), cwd=REPO,
                                  capture_output=True, text=True, check=True).stdout.split() for i in range(2)]
        # torch's hostname check says no in both namespaces; the address of one's own link is here.
        assert answers == [["True", "False"], ["False", "True"]]
        # No route out of the machine: only the bridge's /24.
        routes = subprocess.run(network.wrap(0, ["ip", "route"]), capture_output=True, text=True).stdout
        assert "default" not in routes and "198.18.0.0/24" in routes
    assert our_names(network.owner) == []


def test_a_dead_runs_namespaces_are_found_and_removed():
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, 'scripts'); "
                               "from harness import netns; netns.Network(2).create(); print('up', flush=True); "
                               "time.sleep(60)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        assert our_names(holder.pid)
    finally:
        holder.kill()  # no cleanup of its own runs
        holder.wait()
    assert set(our_names(holder.pid)) <= set(netns.remove_leftovers())
    assert our_names(holder.pid) == []


def test_sigterm_kills_the_nodes_and_removes_the_namespaces(tmp_path):
    harness = subprocess.Popen([sys.executable, "scripts/local_cluster.py", "--netns", "--nodes", "2", "--state-mb", "1",
                                "--scenario", "kill", "--timeout", "60"], cwd=REPO, env=worker_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and len([n for n in our_names(harness.pid) if n.startswith("trn")]) < 3:
        time.sleep(0.2)
    nodes: list[psutil.Process] = []
    while time.time() < deadline and len(nodes) < 2:  # both nodes started in them
        nodes = [p for p in psutil.Process(harness.pid).children() if "launcher.cli" in " ".join(p.cmdline())]
        time.sleep(0.2)
    assert len(nodes) == 2
    harness.send_signal(signal.SIGTERM)
    assert harness.wait(timeout=60) == 128 + signal.SIGTERM
    assert our_names(harness.pid) == []
    assert not [p for p in nodes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def network():
    with netns.Network(4) as made:  # 3 nodes, and a spare
        yield made


def netns_args(network: netns.Network, **overrides) -> argparse.Namespace:
    args = {"nodes": 3, "nproc_per_node": 1, "scenario": "kill", "fault_node": 2, "backend": "c10d",
            "rdzv_endpoint": f"{network.address(0)}:{free_port()}", "state_mb": 1, "interval_steps": 5,
            "timeout": 150, "network": network, "partition_s": 10, "slow_s": 12, "slow_delay_ms": 100,
            "slow_loss_pct": 1}
    args.update(overrides)
    return argparse.Namespace(**args)


def test_a_slow_link_a_partition_and_a_kill_between_namespaces(network, tmp_path):
    runs = run_scenarios(netns_args(network, scenario="slow-link,partition,kill"), tmp_path)
    slow, cut, kill = runs
    # A slow link: training went on, and nobody was declared lost.
    assert slow["commits"] > 0 and slow["false_node_lost"] == 0 and slow["membership_changes"] == []
    # A cut link: the others went on without the node; it did nothing while cut; healed, it rejoined.
    assert cut["cause"] == "node_lost" and (cut["world_size_before"], cut["world_size_after"]) == (3, 2)
    assert cut["work_while_cut"] == [] and not cut["committed_while_cut"]
    assert cut["rejoin"]["world_size_after"] == 3
    # A killed node, then: the survivors of the rejoined world.
    assert (kill["world_size_before"], kill["world_size_after"]) == (3, 2)
    assert kill["restored_step"] is not None and kill["restored_step"] > 0
    # Every agent advertised its own address.
    nodes = {node for e in read_events(tmp_path / "events.jsonl") if e["event"] == "rendezvous_done"
             for node in e["nodes"]}
    assert {node.split("_")[0] for node in nodes} == set(network.addresses[:3])
    for _, path in committed_snapshots(tmp_path / "checkpoints"):
        assert check_snapshot(path).checksummed
