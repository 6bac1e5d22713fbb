"""The harness's scenarios on one job of `torchrevive run` agents: once training is steady (a
snapshot committed), each fault in turn, its recovery timed from the job's event log."""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
from pathlib import Path

from agent.events import read_events
from agent.recovery_timeline import recovery_after
from harness.faults import CHECKED_SCENARIOS, store_host_outcome
from harness.nodes import Cluster
from harness.workloads import compile_cold_s, compile_warm_from, joined_compile_s, split_compile


def run_scenarios(args: argparse.Namespace, work: Path) -> list[dict]:
    cluster = Cluster(args, work)
    scenarios = args.scenario.split(",")
    initial = args.nodes - 1 if scenarios[0] == "join" else args.nodes
    results = []
    try:
        cluster.start_all(initial)
        cluster.wait_for_round_of(initial, args.timeout)  # every node started is in the job before the first fault
        for scenario in scenarios:
            since = time.time()
            cluster.wait_for(lambda ev, t=since: [e for e in ev if e["event"] == "save_committed" and e["time"] > t],
                             args.timeout, "committed snapshot")
            if cluster.memory_interval:  # and a memory snapshot newer than it: what the memory tier is for
                cluster.wait_for(lambda ev, t=since: newer_in_memory(ev, t), args.timeout, "a newer memory snapshot")
            if cluster.compile_caches is not None and scenario == "join":  # the job's caches, shared for the new node
                cluster.wait_for(lambda ev: [e for e in ev if e["event"] == "compile_cache_shared"], args.timeout,
                                 "the compile caches shared")
            fault = args.fault_node if args.fault_node in cluster.nodes else max(cluster.nodes)
            if scenario in CHECKED_SCENARIOS:
                results.append(CHECKED_SCENARIOS[scenario](cluster, args, fault))
                print(f"{scenario:12s} " + json.dumps(results[-1]), flush=True)
                continue
            if scenario == "kill-during-save":  # while an async save is being written
                waiting = time.time()
                cluster.wait_for(lambda ev, t=waiting: [e for e in ev if e["event"] == "save_started" and e["time"] > t],
                                 args.timeout, "an async save")
            else:
                time.sleep(1.0)
            fault_at = time.time()
            if scenario == "store-host":
                fault = 0
            if scenario in ("kill", "kill-during-save", "kill-during-restore", "store-host"):
                cluster.kill(fault)
            elif scenario == "freeze":
                cluster.signal(fault, signal.SIGSTOP)
            elif scenario == "join":
                cluster.start(max(cluster.nodes) + 1)
            elif scenario == "kill-worker":
                cluster.kill_worker(fault)
            else:
                raise SystemExit(f"--scenario: unknown scenario {scenario!r}")
            if scenario == "kill-during-restore":  # a second node dies while the survivors restore
                cluster.wait_for(lambda ev, t=fault_at: [e for e in ev if e["event"] == "workers_started"
                                                          and e["time"] > t], args.timeout, "the recovery's workers")
                fault_at = time.time()
                cluster.kill(max(cluster.nodes))
            if scenario == "store-host":
                results.append(store_host_outcome(cluster, args, fault_at))
                print(f"{scenario:12s} " + json.dumps(results[-1]), flush=True)
                continue
            timeline = cluster.wait_for(lambda ev, t=fault_at: recovery_after(ev, t, failed_at=t), args.timeout,
                                        f"recovery after {scenario}")
            # The step training had reached when the agents stopped it (a kill stops it at once,
            # a join that waited for a commit later).
            reached = cluster.step_at(fault_at + timeline["phases"]["detect"])
            if reached is not None and timeline["restored_step"] is not None:
                # In-process, the survivors can hold a step rank 0 never marked (its mark follows
                # the step's loss all-reduce, which the fault broke): none is lost then.
                timeline["steps_lost"] = max(0, reached - timeline["restored_step"])
            marks = read_events(cluster.marks)
            timeline["stall_s"] = training_gap(marks, fault_at)
            timeline["step_s"] = steady_step_s(marks, fault_at)
            timeline["resume_s"] = timeline["recovery_s"] - (timeline["step_s"] or 0.0)
            steps_after = getattr(args, "steps_after", 0)
            if steps_after:
                gaps = cluster.wait_for(lambda marks, t=fault_at: steps_after_recovery(marks, t, steps_after),
                                        args.timeout, f"{steps_after} steps after the recovery", path=cluster.marks)
                timeline["new_world_step_s"] = statistics.median(gaps)
                timeline["resume_new_world_s"] = timeline["recovery_s"] - timeline["new_world_step_s"]
            split_compile(timeline, marks, fault_at)
            events = read_events(cluster.events)
            timeline["compile_cold_s"] = compile_cold_s(marks, events)
            timeline["compile_warm_from"] = compile_warm_from(events, fault_at)
            if scenario == "join":
                timeline["compile_joined_s"] = joined_compile_s(events, fault_at)
            results.append({"scenario": scenario, "fault_at": fault_at, **timeline})
            print(f"{scenario:12s} recovered in {timeline['recovery_s']:.2f} s, world size "
                  f"{timeline['world_size_before']} -> {timeline['world_size_after']}  "
                  + "  ".join(f"{k} {v:.2f}" for k, v in timeline["phases"].items()), flush=True)
            if scenario == "freeze":
                cluster.signal(fault, signal.SIGCONT)  # it finds itself evicted and rejoins as a new node
                thawed_at = time.time()
                cluster.wait_for(lambda ev, t=thawed_at: recovery_after(ev, t), args.timeout, "the thawed node's rejoin")
    finally:
        cluster.stop()
    return results


def newer_in_memory(events: list[dict], since: float) -> bool:
    """Whether a memory snapshot newer than the newest storage snapshot was committed after ``since``."""
    storage = max((e["step"] for e in events if e["event"] == "save_committed"), default=-1)
    return any(e["event"] == "memory_save_committed" and e["time"] > since and e["step"] > storage for e in events)


def training_gap(marks: list[dict], after: float) -> float | None:
    """How long the job trained no step around a fault at ``after``: from the last step rank 0
    finished before the recovered job's first step to that first step (None before it). For a
    kill it is about the recovery; for a join, whose new node starts while the job trains on, it
    is the job's own pause."""
    steps, first = _steps_and_recovered_first(marks, after)
    return steps[first]["time"] - steps[first - 1]["time"] if first else None


def steps_after_recovery(marks: list[dict], fault_at: float, count: int) -> list[float] | None:
    """The times of the ``count`` steps rank 0 finished after the recovered job's first step (after
    a fault at ``fault_at``), each since the step before; None until there are that many at its
    world size."""
    steps, first = _steps_and_recovered_first(marks, fault_at)
    if first is None:
        return None
    following = steps[first:first + count + 1]
    if len(following) <= count or any(m["world_size"] != steps[first]["world_size"] for m in following):
        return None
    return [b["time"] - a["time"] for a, b in zip(following, following[1:])]


def _steps_and_recovered_first(marks: list[dict], after: float) -> tuple[list[dict], int | None]:
    """Rank 0's step marks in time order, and the index of the recovered job's first step after
    ``after`` (None before it)."""
    steps = sorted((m for m in marks if m["event"] in ("step", "first_step_done")), key=lambda m: m["time"])
    first = next((i for i, m in enumerate(steps) if m["event"] == "first_step_done" and m["time"] > after), None)
    return steps, first


def steady_step_s(marks: list[dict], before: float) -> float | None:
    """The median time between two of rank 0's steps before ``before`` (None with fewer than two)."""
    times = sorted(m["time"] for m in marks if m["event"] == "step" and m["time"] < before)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None
