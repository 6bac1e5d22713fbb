"""The same fault on a baseline instead of torchrevive: plain torchrun with the classic restore,
torchft or NVIDIA's ft_launcher, timed from its step marks."""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Callable
from pathlib import Path

from agent.events import read_events
from harness.nodes import ClassicCluster, Nodes
from harness.nvrx_cluster import NvrxCluster
from harness.peers_env import peers_python
from harness.torchft_cluster import TorchftCluster


def run_baseline(args: argparse.Namespace, work: Path, scenario: str, approach: str, *,
                 unshared_store: bool = False) -> dict:
    """The same fault on a baseline (``approach``: torchrun with the classic restore, torchft or
    nvrx, see BASELINES), timed from its step marks and capped at --cap-s: ``recovery_s`` from
    the fault to the first step of the job as re-formed (a restarted job's first step, or the first
    step at another world size), ``pause_s`` the longest time between two steps until then.
    ``unshared_store``: see ClassicCluster."""
    work = work / ("baseline-unshared" if unshared_store else f"baseline-{approach}")
    work.mkdir(parents=True, exist_ok=True)
    nodes = BASELINES[approach](args, work, unshared_store)
    try:
        nodes.start_all(args.nodes - 1 if scenario == "join" else args.nodes)
        nodes.wait_for(lambda marks: any(m["event"] == "saved" for m in marks), args.timeout, "baseline checkpoint")
        time.sleep(1.0)
        fault_at = time.time()
        before = [m for m in read_events(nodes.records) if m["event"] in ("step", "first_step_done")][-1]
        victim = min(args.fault_node, max(nodes.nodes))
        if scenario == "kill":
            nodes.kill(victim)
        elif scenario == "freeze":
            nodes.signal(victim, signal.SIGSTOP)
        elif scenario == "join":
            nodes.start(len(nodes.nodes))
        elif scenario == "kill-worker":
            nodes.kill_worker(victim)
        base = {"approach": approach, "cap_s": args.cap_s, "peer_config": nodes.peer_config}
        try:
            resumed = nodes.wait_for(lambda marks: reformed(marks, fault_at, before["world_size"]), args.cap_s,
                                     "baseline recovery")
        except TimeoutError:
            return {**base, "recovery_s": None, "capped": True, "pause_s": None}
        steps = [m["time"] for m in read_events(nodes.records)
                 if m["event"] in ("step", "first_step_done") and before["time"] <= m["time"] <= resumed["time"]]
        return {**base, "recovery_s": resumed["time"] - fault_at, "capped": False,
                "pause_s": max(b - a for a, b in zip(steps, steps[1:]))}
    finally:
        nodes.stop()


def reformed(marks: list[dict], after: float, world_size: int) -> dict | None:
    """The first step after ``after`` of the job as re-formed: a restarted job's first step, or a
    step at a world size other than ``world_size``."""
    return next((m for m in marks if m["time"] > after and (m["event"] == "first_step_done" or (
        m["event"] == "step" and m["world_size"] != world_size))), None)


def _torchrun_baseline(args: argparse.Namespace, work: Path, unshared_store: bool) -> Nodes:
    return ClassicCluster(args, work, args.baseline_endpoint, unshared_store=unshared_store)


def _torchft_baseline(args: argparse.Namespace, work: Path, unshared_store: bool) -> Nodes:
    return TorchftCluster(args, work, marks=work / "marks.jsonl", peers_python=peers_python())


def _nvrx_baseline(args: argparse.Namespace, work: Path, unshared_store: bool) -> Nodes:
    return NvrxCluster(args, work, marks=work / "marks.jsonl", peers_python=peers_python(), max_restarts=5)


BASELINES: dict[str, Callable[[argparse.Namespace, Path, bool], Nodes]] = {
    "torchrun": _torchrun_baseline, "torchft": _torchft_baseline, "nvrx": _nvrx_baseline}
"""--baseline choices: plain torchrun with the classic restore (examples/classic_train.py), and
the peers (harness.torchft_cluster, harness.nvrx_cluster), from their own environment."""
