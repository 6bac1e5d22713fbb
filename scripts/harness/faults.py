"""Faults that report their own checks (and "ok") instead of a recovery: a network partition, a
slow link, a node starved of CPU, etcd's leader killed, and what becomes of a job whose c10d store
host was killed."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from agent.events import read_events
from agent.recovery_timeline import recovery_after
from harness.nodes import Cluster


def _events_between(cluster: Cluster, start: float, end: float, names: set[str]) -> list[dict]:
    return [e for e in read_events(cluster.events) if start <= e["time"] <= end and e["event"] in names]


def partition(cluster: Cluster, args: argparse.Namespace, fault: int) -> dict:
    """Cut node ``fault``'s link; the others recover without it; heal it after --partition-s; it
    rejoins as a new node. Checks that its processes recorded nothing of a round while cut."""
    network = cluster.network
    address, pids = network.address(fault), cluster.pids(fault)
    cut_at = time.time()
    network.cut(fault)
    down_at = time.time()  # `ip` itself can take a second on a loaded node: the link is down from here
    try:
        survivors = cluster.wait_for(lambda ev: recovery_after(ev, cut_at, failed_at=cut_at), args.timeout,
                                     "the survivors' recovery")
        while time.time() < cut_at + args.partition_s:
            pids |= cluster.pids(fault)
            time.sleep(0.2)
        pids |= cluster.pids(fault)
    finally:
        network.heal(fault)
    healed_at = time.time()
    stale = [e for e in _events_between(cluster, down_at, healed_at, STALE_WORK)
             if e.get("pid") in pids or str(e.get("node", "")).startswith(f"{address}_")]
    rejoin = cluster.wait_for(lambda ev: recovery_after(ev, healed_at), args.timeout, "the healed node's rejoin")
    ok = (not stale and survivors["world_size_after"] < survivors["world_size_before"]
          and rejoin["world_size_after"] == survivors["world_size_before"])
    return {"scenario": "partition", **survivors, "partition_s": healed_at - cut_at, "rejoin": rejoin,
            "work_while_cut": stale, "committed_while_cut": any(e["event"] == "save_committed" for e in stale),
            "ok": ok}


STALE_WORK = {"save_committed", "rendezvous_done", "workers_started", "first_step_done", "restore_done"}
"""Events a cut-off node must not record: it takes part in no round while it cannot be reached.
(``save_started`` is a local copy: a step whose all-reduce ended just before the cut may stage one.)"""


def _steady(cluster: Cluster, args: argparse.Namespace, seconds: float) -> dict:
    """Watch the job for ``seconds``: commits made and membership changes recorded meanwhile."""
    start = time.time()
    time.sleep(seconds)
    changes = _events_between(cluster, start, time.time(), {"membership_change"})
    commits = _events_between(cluster, start, time.time(), {"save_committed"})
    steps = [e["step"] for e in commits]
    return {"seconds": seconds, "commits": len(commits), "steps": [min(steps), max(steps)] if steps else [],
            "membership_changes": [{k: e.get(k) for k in ("cause", "lost", "node")} for e in changes]}


def slow_link(cluster: Cluster, args: argparse.Namespace, fault: int) -> dict:
    """Delay (and drop) node ``fault``'s packets for --slow-s: training goes on, no node is lost."""
    applied = cluster.network.slow(fault, args.slow_delay_ms, args.slow_loss_pct)
    try:
        watched = _steady(cluster, args, args.slow_s)
    finally:
        cluster.network.unslow(fault)
    false_losses = [c for c in watched["membership_changes"] if c["cause"] in ("node_lost", "node_hung")]
    return {"scenario": "slow-link", "shaping": applied, **watched, "false_node_lost": len(false_losses),
            "ok": not false_losses and watched["commits"] > 0}


def cpu_hog(cluster: Cluster, args: argparse.Namespace, fault: int) -> dict:
    """Starve node ``fault`` of CPU for --slow-s: its agent and workers at nice 10 beside two busy
    processes per core at nice 0 (as root, who can give the node its priority back; else four
    busy processes per core beside it). The node is slow, not dead: training goes on and no node
    is declared lost, by its heartbeats or by its liveness connections."""
    node = psutil.Process(cluster.nodes[fault].pid)
    niced = os.geteuid() == 0
    starved = [node, *node.children(recursive=True)] if niced else []
    for proc in starved:
        proc.nice(10)
    per_core = 2 if niced else 4
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(per_core * (os.cpu_count() or 1))]
    started = time.time()
    try:
        watched = _steady(cluster, args, args.slow_s)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        for proc in starved:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.nice(0)
    steps = [cluster.step_at(started), cluster.step_at(time.time())]
    false_losses = [c for c in watched["membership_changes"] if c["cause"] in ("node_lost", "node_hung")]
    return {"scenario": "cpu-hog", "hogs": len(hogs), "niced": niced, **watched, "steps_trained": steps,
            "false_node_lost": len(false_losses),
            "ok": not false_losses and None not in steps and steps[1] > steps[0]}


def etcd_leader(cluster: Cluster, args: argparse.Namespace, fault: int) -> dict:
    """SIGKILL the etcd cluster's leader: training goes on with no restart, every snapshot stays."""
    etcd = getattr(args, "etcd_cluster", None)
    if etcd is None:
        raise SystemExit("--scenario etcd-leader needs --backend etcd3 with the etcd cluster this script starts")
    from agent.checkpoint.dirs import committed_snapshots

    checkpoints = Path(cluster.work / "checkpoints")
    newest_before = max((step for step, _ in committed_snapshots(checkpoints)), default=-1)
    leader = etcd.leader()
    leader.kill()
    watched = _steady(cluster, args, args.slow_s)
    newest_after = max((step for step, _ in committed_snapshots(checkpoints)), default=-1)
    ok = not watched["membership_changes"] and watched["commits"] > 0 and newest_after > newest_before
    return {"scenario": "etcd-leader", "leader": leader.name, **watched, "newest_step_before": newest_before,
            "newest_step_after": newest_after, "ok": ok}


def store_host_outcome(cluster: Cluster, args: argparse.Namespace, fault_at: float) -> dict:
    """After node 0 (the c10d store host) is killed: whether the job recovered within
    --store-host-wait-s, else when each surviving agent exited and how. Under c10d the store dies
    with its host (docs/reference.md#fault-injection); under etcd3 the job recovers as from any node's loss."""
    timeline, exited = None, {}
    deadline = time.time() + args.store_host_wait_s
    while time.time() < deadline and timeline is None and len(exited) < len(cluster.nodes):
        timeline = recovery_after(read_events(cluster.events), fault_at, failed_at=fault_at)
        for index, proc in cluster.nodes.items():
            if index not in exited and proc.poll() is not None:
                exited[index] = {"exit_code": proc.returncode, "after_s": time.time() - fault_at}
        time.sleep(0.2)
    seen = _events_between(cluster, fault_at, time.time(), {"membership_change", "rendezvous_done",
                                                            "first_step_done"})
    return {"scenario": "store-host", "recovered": timeline is not None, **(timeline or {}),
            "agents_exited": exited, "events_after": sorted({e["event"] for e in seen}),
            "ok": timeline is not None or args.backend == "c10d"}


CHECKED_SCENARIOS: dict[str, Callable[[Cluster, argparse.Namespace, int], dict]] = {
    "partition": partition, "slow-link": slow_link, "etcd-leader": etcd_leader, "cpu-hog": cpu_hog}
"""Scenarios that report their own checks (and "ok") instead of a recovery."""
