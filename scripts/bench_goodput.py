"""Goodput under a schedule of node kills: the same job (examples/mlp.py's MLP and data, Adam, K
nodes on 127.0.0.1; or, with --workload gpt, the compiled FSDP2 GPT of examples/gpt/train.py, for
torchrevive's approaches) run for the same time by each approach, with the same kills at the same times.

    python scripts/bench_goodput.py --nodes 4 --state-mb 512 --duration-s 480 --kill-every-s 120 \\
        --rejoin-after-s 30 --memory-interval 10 --json out.json
    python scripts/bench_goodput.py --workload gpt --interval-steps 5 --memory-interval 2 \\
        --approaches fault_free,torchrevive_storage,torchrevive_in_process --json out.json

Every --kill-every-s seconds a node (never node 0, which hosts the c10d store and the peers'
coordinators; the victims rotate over the others that are up) is killed with SIGKILL, agent and
workers, and comes back --rejoin-after-s seconds later. Approaches (--approaches; one APPROACHES entry each):
  fault_free           torchrevive, no faults: the reference
  torchrevive_memory   torchrevive with the memory tier (a snapshot in the nodes' RAM every
                       --memory-interval steps) and the same storage snapshots
  torchrevive_storage  torchrevive, storage snapshots only
  torchrevive_in_process  torchrevive with elastic.in_process: survivors keep their processes and
                       heal from the newest step a live rank holds; a rejoined node heals from a peer
  torchrevive_in_process_memory  both: in-process, and sharded state (FSDP2) restored from the
                       memory tier's snapshot in the peers' RAM (every --memory-interval steps)
  torchrun_classic     plain torchrun (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and
                       examples/classic_train.py: rank 0 torch.load + broadcast
  torchft              torchft 0.2.0: one replica group per node, a Lighthouse on node 0's side;
                       survivors go on, a rejoined group heals from a live peer
                       (scripts/harness/torchft_cluster.py)
  nvrx                 NVIDIA's nvidia-resiliency-ext 0.4.1: ft_launcher's in-job restarts and
                       heartbeats, rank 0 torch.save / torch.load + broadcast (scripts/harness/nvrx_cluster.py)
The peers run from a virtual environment of their own (scripts/setup_peers.sh, made on first use).
All save every --interval-steps steps. Rank 0 (of replica group 0 for torchft) marks every step
with its samples (examples/mlp.py `mark`). torchrevive keeps examples/train.py's global batch (48
samples) at any world size (ElasticSampler's gradient accumulation); the others train 48 / (full
world) samples per rank (torchft: per replica group) a step, so a step at a smaller world trains
fewer samples. The clock starts at t0, the first step the job trains at its full world size
(start-up is no one's cost), and each run is killed at t0 + duration.

samples (and tokens, for the GPT): the samples in the model at t0 + duration: those of every step in
the history of the last step trained by then (a step trained again after a rollback counts once, as
trained last; steps a rollback threw away count not at all), from t0 on. steps: that history's steps
from t0 on. goodput: samples / the fault-free run's samples. A recovery is a restart of training
(after a kill or a rejoin) that completed its first step in time; steps_lost sums, over recoveries,
the highest step trained since the previous restart less the step it restored. pauses: for each
fault, the longest time between two consecutive steps that is its own: the first fault that struck
during it (or one median step before its end: that step was under way) owns it, so a rejoin during a
kill's recovery pauses nothing more; a time no fault struck is the last fault's before it (a save's
stall after a fault counts as that fault's). timeline: [seconds since t0, step, world size] about
every second and around every pause or rollback (scripts/plot_goodput.py draws it).
full_world_step_s: the mean time of a step at the full world size after another such step;
speed_between_faults: the fault-free run's over the approach's (what its saving costs while it
runs). samples_lost: 1 - goodput split by where the samples went, each a share of the fault-free
run's samples: thrown_away (steps rolled back); restarts, full_world, smaller_world (the time
between two steps, filed by the later one: a round's first step, else the world it trained at, at
the fault-free run's rate, less the samples it trained); window_ends (about a step either way).
losses: [step, loss] of each step in the model's history (torchrevive's approaches log it);
loss_vs_fault_free: for an approach that trains the same samples in each step as the fault-free run
(torchrevive's), the largest relative difference between its loss and the fault-free run's at the
same step, over the steps both trained: float summation order moves it by about 1e-7 to 1e-5; a
wrong shard, optimizer moment or data position by far more, and the table flags any above
LOSS_RTOL: samples counted in a model that went wrong are not good ones.

JSON: {"duration_s", "workload", "params", "schedule": [{"at_s", "action", "node"}], "results": {A: {"goodput",
"samples", "thrown_away_samples", "tokens", "steps", "recoveries", "steps_lost", "pauses": [...], "full_world_step_s",
"speed_between_faults", "samples_lost", "time_split", "timeline", "recovery_details": [...], "losses",
"loss_vs_fault_free", "peer_config", ...}}, "date", "machine", ...}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.events import read_events
from harness.goodput_plot import write_beside
from harness.machine import describe
from harness.nodes import ClassicCluster, Cluster, Nodes
from harness.nvrx_cluster import NvrxCluster
from harness.peers_env import peers_python
from harness.ports import free_port
from harness.torchft_cluster import TorchftCluster
from harness.workloads import GPT_SIZES, WORKLOADS, workload_of

MAX_RESTARTS = 1000
"""torchrun's worker-failure restarts for every approach: more than any schedule's kills."""
STEP_EVENTS = ("first_step_done", "step")
SAME_SAMPLES_PER_STEP = ("torchrevive_memory", "torchrevive_storage", "torchrevive_in_process",
                         "torchrevive_in_process_memory")
"""The approaches whose steps train the fault-free run's samples at any world size."""
LOST_TO_STEPS = ("restarts", "full_world", "smaller_world")
"""The kinds of time between steps that :func:`time_split` tells apart."""
LOSS_RTOL = 1e-3
"""A loss further than this from the fault-free run's at the same step is flagged in the table."""


@dataclass(frozen=True)
class Fault:
    """One entry of the schedule: at ``at_s`` seconds after t0, ``action`` node ``node``."""

    at_s: float
    action: str  # "kill" or "rejoin"
    node: int


@dataclass(frozen=True)
class Approach:
    """How one approach runs the job: ``launch(args, work, marks)`` gives its nodes, not yet
    started, whose rank 0 marks every step in ``marks``; ``faults`` whether the schedule applies."""

    launch: Callable[[argparse.Namespace, Path, Path], Nodes]
    faults: bool = True


def torchrevive_nodes(args: argparse.Namespace, work: Path, marks: Path, *, memory_interval: int = 0,
                      in_process: bool = False) -> Nodes:
    """`torchrevive run` agents, storage snapshots every --interval-steps (and memory snapshots
    every ``memory_interval`` steps; survivors re-formed in-process with ``in_process``)."""
    job = argparse.Namespace(**{**vars(args), "memory_interval": memory_interval, "in_process": in_process},
                             backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=MAX_RESTARTS)
    cluster = Cluster(job, work)
    assert cluster.marks == marks, "the harness's step marks are the ones measured"
    return cluster


def torchrevive_memory_nodes(args: argparse.Namespace, work: Path, marks: Path) -> Nodes:
    """`torchrevive run` agents with the memory tier: a memory snapshot every --memory-interval steps."""
    return torchrevive_nodes(args, work, marks, memory_interval=args.memory_interval)


def torchrevive_in_process_nodes(args: argparse.Namespace, work: Path, marks: Path) -> Nodes:
    """`torchrevive run` agents whose survivors keep their processes (elastic.in_process)."""
    return torchrevive_nodes(args, work, marks, in_process=True)


def torchrevive_in_process_memory_nodes(args: argparse.Namespace, work: Path, marks: Path) -> Nodes:
    """In-process, with the memory tier: sharded state heals from the peers' RAM."""
    return torchrevive_nodes(args, work, marks, memory_interval=args.memory_interval, in_process=True)


def classic_nodes(args: argparse.Namespace, work: Path, marks: Path) -> Nodes:
    """Plain torchrun agents with the classic restore."""
    return ClassicCluster(args, work, f"127.0.0.1:{free_port()}", marks=marks, unshared_store=True,
                          max_restarts=MAX_RESTARTS)


def torchft_nodes(args: argparse.Namespace, work: Path, marks: Path) -> Nodes:
    """torchft replica groups, one per node, and their Lighthouse."""
    return TorchftCluster(args, work, marks=marks, peers_python=args.peers_python)


def nvrx_nodes(args: argparse.Namespace, work: Path, marks: Path) -> Nodes:
    """ft_launcher agents with the classic restore."""
    return NvrxCluster(args, work, marks=marks, peers_python=args.peers_python, max_restarts=MAX_RESTARTS)


APPROACHES: dict[str, Approach] = {
    "fault_free": Approach(torchrevive_nodes, faults=False),
    "torchrevive_memory": Approach(torchrevive_memory_nodes),
    "torchrevive_storage": Approach(torchrevive_nodes),
    "torchrevive_in_process": Approach(torchrevive_in_process_nodes),
    "torchrevive_in_process_memory": Approach(torchrevive_in_process_memory_nodes),
    "torchrun_classic": Approach(classic_nodes),
    "torchft": Approach(torchft_nodes),
    "nvrx": Approach(nvrx_nodes),
}
PEERS = {"torchft", "nvrx"}
"""Approaches that run from the peers' virtual environment."""
MLP_ONLY = PEERS | {"torchrun_classic"}
"""Approaches that run a training script of their own, the MLP's only."""


def make_schedule(nodes: int, duration_s: float, kill_every_s: float, rejoin_after_s: float) -> list[Fault]:
    """Kills at every multiple of ``kill_every_s`` before the end, each of the next node in the
    rotation 1, 2, ..., nodes - 1, 1, ... that is up at the time (none when all are down), and
    each killed node's rejoin ``rejoin_after_s`` later when that is before the end."""
    faults: list[Fault] = []
    back_at: dict[int, float] = {}
    turn = 0
    for k in range(1, math.ceil(duration_s / kill_every_s)):
        at = k * kill_every_s
        up = [node for node in (1 + (turn + i) % (nodes - 1) for i in range(nodes - 1)) if back_at.get(node, 0.0) <= at]
        if not up:
            continue
        victim, turn = up[0], up[0] % (nodes - 1)
        back_at[victim] = at + rejoin_after_s
        faults.append(Fault(at, "kill", victim))
        if back_at[victim] < duration_s:
            faults.append(Fault(back_at[victim], "rejoin", victim))
    return sorted(faults, key=lambda f: (f.at_s, f.action == "kill"))


def full_world_start(world_size: int) -> Callable[[list[dict]], dict | None]:
    """A predicate on marks: the first step trained at ``world_size`` ranks."""
    return lambda marks: next((m for m in marks if m["event"] in STEP_EVENTS and m["world_size"] == world_size), None)


def run_approach(approach: Approach, args: argparse.Namespace, schedule: list[Fault], work: Path) -> dict[str, Any]:
    """Run the job from its start to t0 + duration under the schedule; every node killed at the end."""
    work.mkdir(parents=True)
    marks = work / "marks.jsonl"
    nodes = approach.launch(args, work, marks)
    performed: list[tuple[Fault, float]] = []
    try:
        nodes.start_all(args.nodes)
        start = nodes.wait_for(full_world_start(args.nodes * args.nproc_per_node), args.timeout,
                               "first step at the full world size", path=marks)
        t0 = start["time"]
        for fault in schedule if approach.faults else []:
            _sleep_until(t0 + fault.at_s)
            if fault.action == "kill":
                nodes.kill(fault.node)
            else:
                nodes.start(fault.node)
            performed.append((fault, time.time()))
        _sleep_until(t0 + args.duration_s)
    finally:
        nodes.stop()
    return {**measure(read_events(marks), start, args.duration_s, performed), "peer_config": nodes.peer_config}


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.time()))


def measure(marks: list[dict], start: dict, duration_s: float, performed: list[tuple[Fault, float]]) -> dict[str, Any]:
    """Samples, steps, recoveries, steps lost and pauses from the marks of one run (see the module
    docstring)."""
    t0 = start["time"]
    steps = sorted((m for m in marks if m["event"] in STEP_EVENTS and t0 <= m["time"] <= t0 + duration_s),
                   key=lambda m: m["time"])
    history = model_history(steps, start["step"] - 1)
    starts = [m for m in steps if m["event"] == "first_step_done"]
    details = [recovery(restart, previous["time"], steps, performed, t0) for previous, restart in zip(starts, starts[1:])]
    tokens = [m["tokens"] for m in history if "tokens" in m]
    samples = sum(m["samples"] for m in history)
    return {"samples": samples,
            "thrown_away_samples": sum(m["samples"] for m in steps) - samples,
            "time_split": time_split(steps, t0, duration_s, start["world_size"]),
            "tokens": sum(tokens) if tokens else None,
            "steps": len(history),
            "recoveries": len(details),
            # In-process, survivors can hold a step whose mark the fault cut off: none lost then.
            "steps_lost": sum(max(0, d["step_at_failure"] - d["step_restored"]) for d in details),
            "started_from_step": start["step"] - 1,
            "faults": len(performed),
            "pauses": pauses(steps, performed),
            "full_world_step_s": full_world_step_s(steps, start["world_size"]),
            "timeline": timeline(steps, t0),
            "recovery_details": details,
            "losses": [[m["step"], m["loss"]] for m in history if "loss" in m]}


def time_split(steps: list[dict], t0: float, duration_s: float, full_world: int) -> dict[str, Any]:
    """The run's time from t0 to its end by what filled it (see :func:`samples_lost`): each time
    between two consecutive steps, with the samples the later step trained, under "restarts" when
    the later step is a round's first (the fault's detection, the re-formation, the restore, any
    compile and the step itself), else under "full_world" or "smaller_world" (the later step's world
    size); "tail_s": the time after the last step; "start_samples": the samples of the step at t0,
    trained before it."""
    split: dict[str, Any] = {kind: {"seconds": 0.0, "samples": 0} for kind in LOST_TO_STEPS}
    for before, after in zip(steps, steps[1:]):
        kind = ("restarts" if after["event"] == "first_step_done"
                else "full_world" if after["world_size"] == full_world else "smaller_world")
        split[kind]["seconds"] += after["time"] - before["time"]
        split[kind]["samples"] += after["samples"]
    return {**split, "tail_s": t0 + duration_s - steps[-1]["time"], "start_samples": steps[0]["samples"]}


def samples_lost(result: dict[str, Any], reference_samples: int, duration_s: float) -> dict[str, float]:
    """1 - goodput, split by where the samples went, each a share of the fault-free run's samples:
    "thrown_away" (steps trained, then rolled back), and for each kind of :func:`time_split`'s, its
    time at the fault-free run's rate less the samples it trained: "restarts" (the pauses at rounds'
    starts), "full_world" (steps slower than the fault-free run's at the full world: saving, a
    slower machine), "smaller_world" (fewer ranks for a time; here also a starting node's share of
    the CPUs); "window_ends": the tail at that rate less the step at t0, a step's worth either way.
    The terms add up to 1 - goodput."""
    rate = reference_samples / duration_s
    split = result["time_split"]
    lost = {"thrown_away": result["thrown_away_samples"],
            **{kind: rate * split[kind]["seconds"] - split[kind]["samples"] for kind in LOST_TO_STEPS},
            "window_ends": rate * split["tail_s"] - split["start_samples"]}
    return {kind: samples / reference_samples for kind, samples in lost.items()}


def loss_vs_fault_free(losses: list[list[float]], reference: list[list[float]]) -> dict[str, Any] | None:
    """The largest relative difference of ``losses`` from the fault-free ``reference`` at the same
    step (None when no step is in both): {"max_rel_diff", "at_step", "steps_compared"}."""
    expected = {int(step): loss for step, loss in reference}
    diffs = [(abs(loss / expected[int(step)] - 1) if math.isfinite(loss) else math.inf, int(step))
             for step, loss in losses if int(step) in expected and expected[int(step)]]
    if not diffs:
        return None
    worst, at_step = max(diffs)
    return {"max_rel_diff": worst, "at_step": at_step, "steps_compared": len(diffs)}


def timeline(steps: list[dict], t0: float, every_s: float = 1.0) -> list[list[float]]:
    """[seconds since t0, step, world size] of the first step in each ``every_s`` and of every
    step after which training paused or rolled back: steps over time, for a picture."""
    points: list[list[float]] = []
    for m, after in zip(steps, [*steps[1:], None]):
        at = m["time"] - t0
        kept = not points or at - points[-1][0] >= every_s
        if kept or after is None or after["time"] - m["time"] >= every_s or after["step"] <= m["step"]:
            points.append([round(at, 2), m["step"], m["world_size"]])
    return points


def full_world_step_s(steps: list[dict], world_size: int) -> float | None:
    """The mean time of a step at ``world_size`` that followed another (no restart between): how
    fast the approach trains between faults, its saves included (a mean, not a median: a save
    slows a few steps a lot)."""
    times = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])
             if b["event"] == "step" and a["world_size"] == b["world_size"] == world_size and b["step"] == a["step"] + 1]
    return statistics.fmean(times) if times else None


def model_history(steps: list[dict], since_step: int) -> list[dict]:
    """The marks of the steps in the model after the last of ``steps`` (in time order): for each
    step number after ``since_step`` up to the last one's, the mark of its last training."""
    last: dict[int, dict] = {}
    for m in steps:
        last[m["step"]] = m
    final = steps[-1]["step"]
    return [last[n] for n in range(since_step + 1, final + 1) if n in last]


def pauses(steps: list[dict], performed: list[tuple[Fault, float]]) -> list[dict[str, Any]]:
    """For each fault, the longest time between two consecutive steps that is its own: a time is
    the first fault's that struck during it, or up to one median step before it ended (that step
    was under way at the fault); one that no fault struck is the last fault's before it."""
    times = [m["time"] for m in steps]
    gaps = list(zip(times, times[1:]))
    step_s = statistics.median(b - a for a, b in gaps) if gaps else 0.0
    longest: list[float | None] = [None] * len(performed)
    for a, b in gaps:
        struck = [i for i, (_, at) in enumerate(performed) if a - step_s <= at < b]
        before = [i for i, (_, at) in enumerate(performed) if at < a]
        owner = struck[0] if struck else (before[-1] if before else None)
        if owner is not None and (longest[owner] is None or b - a > longest[owner]):
            longest[owner] = b - a
    return [{**asdict(fault), "pause_s": pause} for (fault, _), pause in zip(performed, longest)]


def recovery(restart: dict, since: float, steps: list[dict], performed: list[tuple[Fault, float]],
             t0: float) -> dict[str, Any]:
    """One restart of training: the highest step since the previous start (``since``) before it,
    the step it restored, and the first fault after that start, the one that interrupted training."""
    before = [m["step"] for m in steps if since <= m["time"] < restart["time"]]
    cause = next(((fault, at) for fault, at in performed if since < at < restart["time"]), None)
    return {"first_step_at_s": restart["time"] - t0,
            "step_at_failure": max(before),
            "step_restored": restart["step"] - 1,
            "world_size": restart["world_size"],
            "cause": asdict(cause[0]) if cause else None,
            "recovery_s": restart["time"] - cause[1] if cause else None}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--workload", choices=WORKLOADS, default="mlp",
                        help="mlp: examples/train.py sized by --state-mb; gpt: examples/gpt/train.py (torchrevive's "
                             "approaches only: the others run an MLP script of their own)")
    parser.add_argument("--gpt-size", choices=sorted(GPT_SIZES), default="default", help="--workload gpt: the model")
    parser.add_argument("--compile", choices=("on", "off"), default="on", help="--workload gpt: torch.compile per block")
    parser.add_argument("--state-mb", type=float, default=512, help="--workload mlp: the state's size")
    parser.add_argument("--duration-s", type=float, default=600)
    parser.add_argument("--kill-every-s", type=float, default=60)
    parser.add_argument("--rejoin-after-s", type=float, default=20)
    parser.add_argument("--interval-steps", type=int, default=50, help="storage snapshot interval, every approach")
    parser.add_argument("--memory-interval", type=int, default=1, help="torchrevive_memory's memory snapshot interval")
    parser.add_argument("--approaches", default=",".join(APPROACHES), help=f"comma-separated, of {', '.join(APPROACHES)}")
    parser.add_argument("--timeout", type=float, default=300, help="give up when a job has not started after this long")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, marks, events, checkpoints)")
    parser.add_argument("--work-dir", type=Path, default=None, help="the work dir, kept (default: a new temporary one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.approaches = args.approaches.split(",")
    if unknown := [n for n in args.approaches if n not in APPROACHES]:
        parser.error(f"--approaches: unknown {', '.join(unknown)}; choose from {', '.join(APPROACHES)}")
    if args.workload != "mlp" and (mlp_only := [n for n in args.approaches if n in MLP_ONLY]):
        parser.error(f"--workload {args.workload}: {', '.join(mlp_only)} train(s) the MLP only; leave them out")
    if "fault_free" not in args.approaches:
        parser.error("--approaches must include fault_free: goodput is relative to it")
    if args.nodes < 2:
        parser.error("--nodes must be >= 2: node 0 hosts the c10d store and is never killed")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so that every node is stopped
    schedule = make_schedule(args.nodes, args.duration_s, args.kill_every_s, args.rejoin_after_s)
    args.peers_python = peers_python() if PEERS & set(args.approaches) else None
    keep = args.keep or args.work_dir is not None
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="torchrevive-goodput-"))
    try:
        results = {name: run_approach(APPROACHES[name], args, schedule, work / name) for name in args.approaches}
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    reference = results["fault_free"]
    for result in results.values():
        result["goodput"] = result["samples"] / reference["samples"]
        # Training speed between faults, relative to the fault-free run (what saving costs while it runs).
        step_s = result["full_world_step_s"]
        result["speed_between_faults"] = reference["full_world_step_s"] / step_s if step_s else None
        result["samples_lost"] = samples_lost(result, reference["samples"], args.duration_s)
    for name in SAME_SAMPLES_PER_STEP:
        if name in results:
            results[name]["loss_vs_fault_free"] = loss_vs_fault_free(results[name]["losses"], reference["losses"])
    print_table(results)
    if args.json:
        written = report(args, schedule, results, work if keep else None)
        Path(args.json).write_text(json.dumps(written, indent=2))
        print(f"picture: {write_beside(Path(args.json), written)}", flush=True)


def report(args: argparse.Namespace, schedule: list[Fault], results: dict[str, dict[str, Any]],
           work: Path | None) -> dict[str, Any]:
    """The JSON report: the contract's fields, the run's settings, the schedule, date and machine."""
    workload = workload_of(args)
    return {"duration_s": args.duration_s, "results": results, "schedule": [asdict(f) for f in schedule],
            "workload": workload.name, "params": workload.params, "args": list(workload.args),
            "nodes": args.nodes, "nproc_per_node": args.nproc_per_node, "state_bytes": workload.state_bytes,
            "interval_steps": args.interval_steps, "kill_every_s": args.kill_every_s, "rejoin_after_s": args.rejoin_after_s,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": describe(),
            "work_dir": str(work) if work else None}


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(f"{'approach':20s} {'samples':>8s} {'steps':>7s} {'goodput':>8s} {'recoveries':>10s} {'steps lost':>10s} "
          f"{'median pause s':>14s} {'loss vs fault-free':>18s}")
    for name, r in results.items():
        times = sorted(p["pause_s"] for p in r["pauses"] if p["pause_s"] is not None)
        median = f"{statistics.median(times):.1f}" if times else "-"
        drift = r.get("loss_vs_fault_free")
        loss = "-" if drift is None else f"{drift['max_rel_diff']:.1e}" + (
            f" WRONG at {drift['at_step']}" if not drift["max_rel_diff"] <= LOSS_RTOL else "")
        print(f"{name:20s} {r['samples']:8d} {r['steps']:7d} {r['goodput']:8.3f} {r['recoveries']:10d} "
              f"{r['steps_lost']:10d} {median:>14s} {loss:>18s}")
    kinds = list(next(iter(results.values()))["samples_lost"])
    print(f"\nsamples lost, as shares of the fault-free run's\n{'approach':20s} "
          + " ".join(f"{kind:>13s}" for kind in kinds))
    for name, r in results.items():
        print(f"{name:20s} " + " ".join(f"{r['samples_lost'][kind]:13.3f}" for kind in kinds))


if __name__ == "__main__":
    main()
