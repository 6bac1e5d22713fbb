"""Chaos soak for scripts/local_cluster.py (`--chaos N --seed S`): N faults drawn by a seeded RNG
from FAULT_KINDS, each at a random step of the first half of ONE job that must still finish its
--steps; then the job is checked against a fault-free reference (one process, same steps, seed).

Node 0 (the c10d store host) is never faulted; a killed node stays down until a `join` fault, or
until a fault needs a victim, restarts it as a joining node. Invariants:
  final_model_matches_reference  the final snapshot's model equals the reference's within 1e-5
  snapshots_verify               every committed snapshot passes `torchrevive verify`
  no_stale_commit                each snapshot's round (commit marker) was the job's newest round
                                 (rendezvous_done events) when its marker was written
  no_step_trained_twice          the rounds leading to the final snapshot (each restored its
                                 predecessor's snapshot) trained steps 1..N once each
  samples_match_reference        those steps saw the reference's samples
  faults_recovered               every fault was injected and recovered from, and the job ended 0
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent import restore
from agent.checkpoint.dirs import COMMIT_MARKER, committed_snapshots, snapshot_dir, step_of
from agent.checkpoint.verify import check_snapshot
from agent.errors import RestoreError
from agent.events import read_events
from agent.memory.layout import MemorySnapshot
from agent.recovery_timeline import recovery_after
from harness.faults import partition
from harness.nodes import REPO, Cluster, job_env

FAULT_KINDS = ("kill", "freeze", "partition", "join", "kill-worker", "kill-during-save", "kill-during-restore")
TOLERANCE = 1e-5
"""Final weights may differ by float summation order only (gradients averaged over 1..K ranks)."""


class JobEnded(Exception):
    """The job finished (node 0's agent exited) while a fault waited for something."""


@dataclass
class Soak:
    """One chaos run: the job, the RNG, and which nodes are down."""

    cluster: Cluster
    args: argparse.Namespace
    rng: random.Random
    samples: Path
    down: set[int] = field(default_factory=set)
    started: float = field(default_factory=time.time)

    def wait(self, predicate: Callable[[list[dict]], Any], what: str) -> Any:
        """cluster.wait_for, but JobEnded once node 0's agent exited and ``predicate`` still fails
        (a short job may finish within one poll of the event it waited for)."""
        node0 = self.cluster.nodes[0]

        def done(events: list[dict]) -> Any:
            ended = node0.poll() is not None
            found = predicate(events)
            if not found and ended:
                raise JobEnded(what)
            return found

        return self.cluster.wait_for(done, self.args.timeout, what)

    def recovery(self, since: float, failed_at: float | None = None) -> dict:
        return self.wait(lambda ev: recovery_after(ev, since, failed_at=failed_at), "a recovery")

    def victims(self) -> list[int]:
        """Nodes that may be faulted: live, and not node 0."""
        return sorted(i for i in self.cluster.nodes if i != 0)

    def rejoin(self, index: int) -> dict:
        """Restart a down node as a joining node; its recovery."""
        self.down.discard(index)
        started = time.time()
        self.cluster.start(index)
        return self.recovery(started)

    def kill(self, index: int) -> None:
        self.cluster.kill(index)
        self.down.add(index)


def _kill(soak: Soak, node: int) -> dict:
    at = time.time()
    soak.kill(node)
    return soak.recovery(at, at)


def _freeze(soak: Soak, node: int) -> dict:
    """SIGSTOP; once the others recovered, SIGCONT: it finds itself out of the round and rejoins."""
    at = time.time()
    soak.cluster.signal(node, signal.SIGSTOP)
    try:
        survivors = soak.recovery(at, at)
    finally:
        soak.cluster.signal(node, signal.SIGCONT)
    return {**survivors, "rejoin": soak.recovery(time.time())}


def _partition(soak: Soak, node: int) -> dict:
    return partition(soak.cluster, soak.args, node)


def _join(soak: Soak, node: int) -> dict:
    return soak.rejoin(node)


def _kill_worker(soak: Soak, node: int) -> dict:
    at = time.time()
    soak.cluster.kill_worker(node)
    return soak.recovery(at, at)


def _kill_during_save(soak: Soak, node: int) -> dict:
    waiting = time.time()
    soak.wait(lambda ev: [e for e in ev if e["event"] == "save_started" and e["time"] > waiting], "an async save")
    return _kill(soak, node)


def _kill_during_restore(soak: Soak, node: int) -> dict:
    """Kill ``node``, then another while the survivors' new workers restore."""
    at = time.time()
    soak.kill(node)
    soak.wait(lambda ev: [e for e in ev if e["event"] == "workers_started" and e["time"] > at], "the new workers")
    second = soak.rng.choice(soak.victims())
    at = time.time()
    soak.kill(second)
    return {"second_node": second, **soak.recovery(at, at)}


INJECT: dict[str, Callable[[Soak, int], dict]] = {
    "kill": _kill, "freeze": _freeze, "partition": _partition, "join": _join, "kill-worker": _kill_worker,
    "kill-during-save": _kill_during_save, "kill-during-restore": _kill_during_restore}


def _victims_needed(kind: str) -> int:
    return 2 if kind == "kill-during-restore" else 1


def draw(soak: Soak) -> tuple[str, int]:
    """The next fault and its node; down nodes rejoin first when the fault needs more victims."""
    kinds = [k for k in FAULT_KINDS if k != "partition" or soak.cluster.network is not None]
    kind = soak.rng.choice([k for k in kinds if k != "join" or soak.down])
    if kind == "join":
        return kind, soak.rng.choice(sorted(soak.down))
    for index in sorted(soak.down)[:max(0, _victims_needed(kind) - len(soak.victims()))]:
        soak.rejoin(index)
    return kind, soak.rng.choice(soak.victims())


def current_step(samples: Path) -> int:
    """The step last logged (the file's tail only: it grows by a line per rank and step)."""
    try:
        with open(samples, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except ValueError:
            continue
    return 0


def inject(soak: Soak, at_step: int) -> dict:
    """Wait until the job trained ``at_step``, then draw a fault, inject it and wait out its recovery."""
    soak.wait(lambda ev: current_step(soak.samples) >= at_step, f"step {at_step}")
    kind, node = draw(soak)
    at, step = time.time(), current_step(soak.samples)
    print(f"chaos: {kind} node {node} at step {step} ({at - soak.started:.1f} s)", flush=True)
    outcome = INJECT[kind](soak, node)
    return {"kind": kind, "node": node, "step": step, "at_s": round(at - soak.started, 2),
            "recovery_s": outcome.get("recovery_s"), "world_size_after": outcome.get("world_size_after"),
            **({"ok": outcome["ok"]} if "ok" in outcome else {}),
            **({"second_node": outcome["second_node"]} if "second_node" in outcome else {})}


def run_chaos(args: argparse.Namespace, work: Path) -> dict:
    """The soak: one job, ``args.chaos`` faults, then the invariants."""
    rng = random.Random(args.seed)
    samples = work / "samples.jsonl"
    args.train_args = ["--log-samples", str(samples)]
    args.keep_snapshots = 1_000_000  # every commit stays, to be verified and fenced-checked
    cluster = Cluster(args, work)
    soak = Soak(cluster, args, rng, samples)
    # In the first half: a joining node takes seconds to start while the others train on, and
    # the job must not finish before the last fault's recovery.
    targets = sorted(rng.randint(args.steps // 20, args.steps // 2) for _ in range(args.chaos))
    faults: list[dict] = []
    try:
        cluster.start_all(args.nodes)
        for target in targets:
            faults.append(inject(soak, target))
        exit_codes = cluster.wait_done(args.timeout)
    except JobEnded as ended:
        faults.append({"kind": "none", "error": f"the job ended while waiting for {ended}"})
        exit_codes = cluster.wait_done(args.timeout)
    finally:
        cluster.stop()
    duration = time.time() - soak.started
    reference = reference_run(work / "reference", args.steps, cluster.width)
    invariants, details = check(work, args.steps, cluster.width, reference)
    invariants["faults_recovered"] = (len(faults) == args.chaos and not any("error" in f for f in faults)
                                      and all(f.get("ok", True) for f in faults) and not any(exit_codes))
    return {"seed": args.seed, "steps": args.steps, "duration_s": round(duration, 1), "faults": faults,
            "exit_codes": exit_codes, "invariants": invariants, "details": details, "ok": all(invariants.values())}


def reference_run(work: Path, steps: int, width: int) -> Path:
    """The same training, fault-free, in one process; its checkpoint dir (samples in samples.jsonl)."""
    work.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "run", "--standalone", "--nproc-per-node", "1",
         "--set", f"checkpoint.dir={work}", "--set", "checkpoint.interval_steps=5", "examples/train.py",
         "--steps", str(steps), "--width", str(width), "--log-samples", str(work / "samples.jsonl")],
        cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the reference run failed:\n{done.stdout[-2000:]}")
    return work


def final_model(snapshot: Path, width: int) -> dict[str, torch.Tensor]:
    """The model of a snapshot examples/train.py wrote (DDP: its keys start with "module.")."""
    from examples.mlp import build_model

    model = torch.nn.Module()
    model.module = build_model(width, torch.device("cpu"))
    restore(snapshot, {"model": model})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def samples_by_round(samples: Path) -> dict[Any, dict[int, list[int]]]:
    """Each round's steps and their samples (all ranks', sorted), from a --log-samples file."""
    rounds: dict[Any, dict[int, list[int]]] = {}
    for line in samples.read_text().splitlines():
        record = json.loads(line)
        rounds.setdefault(record.get("round"), {}).setdefault(record["step"], []).extend(record["ids"])
    return {r: {step: sorted(ids) for step, ids in steps.items()} for r, steps in rounds.items()}


def lineage(checkpoints: Path, events: list[dict], final_step: int) -> list[tuple[int, int, int]]:
    """(round, restored step, committed step) of each round leading to the final snapshot, oldest
    first: the final snapshot's round, the round that committed the snapshot it restored, ...
    It stops at a round that restored a snapshot no older than its own commit."""
    restored = {e["round"]: e.get("restore_from") for e in events if e["event"] == "rendezvous_done"}
    chain, snapshot = [], snapshot_dir(checkpoints, final_step)
    while snapshot is not None:
        step = step_of(snapshot)
        round_ = _committed_by(snapshot)
        source = restored.get(round_)
        chain.append((round_, step_of(Path(source)) if source else 0, step))
        snapshot = Path(source) if source and chain[-1][1] < step else None
    return chain[::-1]


def _committed_by(snapshot: Path) -> int:
    """The round that committed ``snapshot``: its marker's, or for a memory snapshot (gone with
    its node's tmpfs) the round its path names (r<round>/step_<N>)."""
    try:
        return MemorySnapshot.parse(f"{snapshot.parent.name}/{snapshot.name}").round
    except ValueError:
        return json.loads((snapshot / COMMIT_MARKER).read_text())["round"]


def check(work: Path, steps: int, width: int, reference: Path) -> tuple[dict[str, bool], dict[str, Any]]:
    """The invariants of a finished soak, and what they found."""
    checkpoints, events = work / "checkpoints", read_events(work / "events.jsonl")
    committed = committed_snapshots(checkpoints)
    bad = [str(path) for _, path in committed if not _verifies(path)]
    stale = _stale_commits(committed, events)
    trained = samples_by_round(work / "samples.jsonl")
    (expected,) = samples_by_round(reference / "samples.jsonl").values()  # one round: no fault
    chain = lineage(checkpoints, events, steps) if snapshot_dir(checkpoints, steps).is_dir() else []
    chain_steps = [s for round_, start, end in chain for s in sorted(trained.get(round_, {})) if start < s <= end]
    twice = (chain_steps != list(range(1, steps + 1))
             or any(min(trained.get(r, {0: 0})) != start + 1 for r, start, _ in chain))
    by_step = {s: trained[r][s] for r, start, end in chain for s in trained.get(r, {}) if start < s <= end}
    diff = _model_difference(checkpoints, reference, steps, width) if chain else float("inf")
    return ({"final_model_matches_reference": diff <= TOLERANCE, "snapshots_verify": bool(committed) and not bad,
             "no_stale_commit": not stale, "no_step_trained_twice": not twice,
             "samples_match_reference": by_step == expected},
            {"max_weight_difference": diff, "snapshots": len(committed), "failed_verify": bad,
             "stale_commits": stale, "lineage": chain, "rounds": len(trained)})


def _verifies(path: Path) -> bool:
    try:
        return check_snapshot(path).checksummed
    except RestoreError:
        return False


def _stale_commits(committed: list[tuple[int, Path]], events: list[dict]) -> list[dict]:
    """Snapshots whose round was not the newest round formed when their marker was written."""
    rounds = sorted((e["time"], e["round"]) for e in events if e["event"] == "rendezvous_done")
    stale = []
    for step, path in committed:
        marker = json.loads((path / COMMIT_MARKER).read_text())
        current = max((r for t, r in rounds if t <= marker["committed_at"]), default=None)
        if marker["round"] != current:
            stale.append({"step": step, "round": marker["round"], "current_round": current})
    return stale


def _model_difference(checkpoints: Path, reference: Path, steps: int, width: int) -> float:
    ours, theirs = final_model(snapshot_dir(checkpoints, steps), width), final_model(snapshot_dir(reference, steps), width)
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
