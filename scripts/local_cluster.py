"""Fault-injection harness: K `torchrevive run` agents ("nodes") on 127.0.0.1 training
examples/train.py with a state of a chosen size (or, with `--workload gpt`, the compiled FSDP2
transformer of examples/gpt/train.py); once training is steady (a snapshot committed), a fault is
injected and the recovery is timed from the job's event log.

    python scripts/local_cluster.py --nodes 4 --nproc-per-node 1 --scenario kill --state-mb 512 \\
        --baseline --json out.json

Scenarios (several, comma-separated, run in sequence on the same job):
  kill         SIGKILL a node (its agent and workers)
  freeze       SIGSTOP a node; it is thawed (SIGCONT) after the others recovered, and rejoins
  join         a node starts (the job starts with one node fewer) and the job grows
  kill-worker  SIGKILL one worker process of a node
  kill-during-save     SIGKILL a node while an async save is being written
  kill-during-restore  SIGKILL a node, then another while the survivors restore
  cpu-hog      starve a node of CPU for --slow-s s (nice 10 beside busy processes): it is slow, not
               dead, and no node is declared lost
`--chaos N --seed S` instead injects N faults drawn at random from kill, freeze, partition (with
--netns), join, kill-worker, kill-during-save and kill-during-restore into one job of --steps, and
checks the finished job against a fault-free reference (scripts/chaos.py; JSON "chaos": {"faults",
"invariants", "ok"}; exit code 1 unless ok).
With --netns, each node runs in a network namespace of its own (scripts/netns.py: addresses
198.18.0.1.. on one bridge, no route out; needs root), and network faults are possible:
  partition    cut the node's link for --partition-s s, then heal it: the others go on without it,
               it commits and serves nothing while cut, and rejoins as a new node once healed
  slow-link    delay (and drop, where the kernel has netem) the node's packets for --slow-s s:
               training goes on, and no node is declared lost
  store-host   SIGKILL node 0 (the c10d store host): c10d's fate is reported, etcd3 recovers
  etcd-leader  (etcd3, with an etcd cluster of 3 this script starts) SIGKILL etcd's leader:
               training goes on with no restart, and no committed snapshot is lost
Node 0 is started first and hosts the c10d store; the fault hits node --fault-node (default the
last). `--baseline` runs the same scenario with plain torchrun and the classic restore (rank 0
torch.load + broadcast, examples/classic_train.py), capped at --cap-s, twice: with torch's
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (JSON "baseline": the torchrun that recovers) and as torch
ships it (JSON "baseline_shared_store"). `--baseline torchft` and `--baseline nvrx` run it on a
peer instead (scripts/torchft_cluster.py, scripts/nvrx_cluster.py; their environment is made by
scripts/setup_peers.sh on first use).

`--memory-interval K` turns the memory tier on (a memory snapshot every K steps); each node then
mounts a tmpfs of its own (--memory-mb) at one path, in a mount namespace of its own (root).

JSON: {"scenario", "backend", "nodes", "nproc_per_node", "workload", "params", "state_bytes", "torchrevive": {"recovery_s",
"world_size_before", "world_size_after", "restored_step", "restore_source" (memory or storage),
"bytes_from_storage", "steps_lost" (the step reached when the agents stopped training, at the fault or,
for a join that waited for a commit, after it, less the step restored), "deferred_s", "stall_s" (the job's
pause in training: from rank 0's last step before the recovered job's first step to it; for a join,
whose new node starts while the job trains on, less than recovery_s), "phases":
{detect, rendezvous, workers_start, restore, first_step, and for a compiled GPT compile: the compile time
of the first step after the restart, carved out of first_step}, "compile_cold_s" (the job's first compile;
None for the MLP), "compile_warm_from" (with --compile-cache per-node: what the workers started after the
fault compiled from, the coldest node's: "local" caches, "snapshot" (the copy in the checkpoint dir) or
"none"), for a join "compile_joined_s" (the joining node's compile: in its rehearsal, or in its first step on
the restart path), "recompiles" (graphs dynamo compiled for that first step), "path" ("in_process" when the
survivors kept their processes, else "restart"), "fallback_reason", "step_s" (the median steady step before
the fault), "resume_s" (recovery_s less one steady step)}, "baseline": {"approach", "recovery_s" (from the
fault to the re-formed job's first step), "pause_s" (the longest time between two steps until then),
"capped", "cap_s", "peer_config"}}; with several scenarios, "runs" holds
one such torchrevive result per scenario. With --netns, "addresses" (one per node). A network
fault's run holds its checks, and "ok" when all hold.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml
from local_ports import free_port

from workloads import (
    GPT_SIZES,
    WORKLOADS,
    compile_cold_s,
    compile_warm_from,
    joined_compile_s,
    split_compile,
    width_for,
    workload_of,
)

from agent.events import read_events
from agent.recovery_timeline import recovery_after
from agent.report_plot import draw_timeline

REPO = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 48
"""examples/train.py's samples per step (--global-batch-size), at every world size."""
CHAOS_STEPS = 300
"""A chaos soak's steps unless --steps says otherwise: its faults fall between steps 15 and 150."""


def per_rank_batch(args: argparse.Namespace) -> int:
    """The samples per rank a step of a job with a fixed per-rank batch (the classic baseline and
    the peers): examples/train.py's global batch at the full world of ``args.nodes`` nodes."""
    return max(1, GLOBAL_BATCH // (args.nodes * args.nproc_per_node))


class Nodes:
    """The node processes of one job, each in its own session so that a node's agent and workers
    are signalled together. Subclasses say how a node is launched (``command``)."""

    script = "examples/train.py"
    log_prefix = "node"

    def __init__(self, work: Path, records: Path, env: dict[str, str]) -> None:
        self.work = work
        self.records = records
        self.env = env
        self.nodes: dict[int, subprocess.Popen] = {}

    def command(self, index: int) -> list[str]:
        """The command line of node ``index``."""
        raise NotImplementedError

    @property
    def peer_config(self) -> dict[str, Any]:
        """The settings that bound this approach's detection and recovery, for the reports."""
        raise NotImplementedError

    def start(self, index: int) -> None:
        """Start node ``index`` (again, for a node that comes back: its log is appended to)."""
        log = open(self.work / f"{self.log_prefix}{index}.log", "a")  # noqa: SIM115 (open for the node's lifetime)
        self.nodes[index] = subprocess.Popen(self.command(index), cwd=REPO, env=self.env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)

    def start_all(self, count: int) -> None:
        """Start nodes 0 .. count - 1; node 0 first, so that it binds the c10d store."""
        for index in range(count):
            self.start(index)
            time.sleep(0.5 if index == 0 else 0.1)

    def signal(self, index: int, sig: signal.Signals) -> None:
        """Signal a node: its agent and every worker (torch starts workers in sessions of their own)."""
        _signal_tree(self.nodes[index].pid, sig)

    def kill(self, index: int) -> None:
        """SIGKILL a node, agent and workers, and forget it."""
        _kill_tree(self.nodes[index].pid)
        self.nodes.pop(index).wait()

    def pids(self, index: int) -> set[int]:
        """Node ``index``'s agent and workers, as they are now."""
        try:
            root = psutil.Process(self.nodes[index].pid)
            return {root.pid, *(p.pid for p in root.children(recursive=True))}
        except (psutil.NoSuchProcess, KeyError):
            return set()

    def kill_worker(self, index: int) -> None:
        workers = [p for p in psutil.Process(self.nodes[index].pid).children(recursive=True)
                   if self.script in " ".join(p.cmdline())]
        workers[-1].kill()

    def wait_done(self, timeout: float) -> list[int]:
        """Wait for every node's agent to exit (a job with a finite --steps); their exit codes."""
        deadline = time.time() + timeout
        return [proc.wait(timeout=max(1.0, deadline - time.time())) for proc in self.nodes.values()]

    def stop(self) -> None:
        """Kill every node, frozen ones included, and reap them."""
        for proc in self.nodes.values():
            _signal_tree(proc.pid, signal.SIGCONT)
            _kill_tree(proc.pid)
            proc.wait()

    def wait_for(self, predicate: Callable[[list[dict]], Any], timeout: float, what: str,
                 path: Path | None = None) -> Any:
        """Poll the JSON-lines file ``path`` (default: this job's records) until ``predicate`` of
        its lines is truthy, and return that; TimeoutError after ``timeout`` seconds."""
        path = path or self.records
        deadline = time.time() + timeout
        while time.time() < deadline:
            found = predicate(read_events(path) if path.exists() else [])
            if found:
                return found
            time.sleep(0.2)
        raise TimeoutError(f"no {what} within {timeout:.0f} s; see the node logs in {self.work}")


class Cluster(Nodes):
    """K `torchrevive run` agents of one job training examples/train.py; its records are the
    job's event log."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.network = getattr(args, "network", None)
        env = job_env()
        if self.network is not None:  # the same link name in every namespace
            from netns import LINK

            env["GLOO_SOCKET_IFNAME"] = LINK
        super().__init__(work, work / "events.jsonl", env)
        self.args = args
        self.events = self.records
        self.workload = workload_of(args)
        self.config = work / "job.yaml"
        self.marks = work / "marks.jsonl"
        self.memory_interval = getattr(args, "memory_interval", 0)
        # With the memory tier, each node mounts a tmpfs of its own at this path in a mount
        # namespace of its own: one path, a separate RAM disk per node, gone with the node.
        self.memory_dir = Path(tempfile.mkdtemp(prefix="torchrevive-memory-", dir="/dev/shm")) \
            if self.memory_interval else None
        self.memory_mb = getattr(args, "memory_mb", None) or max(64, math.ceil(4 * args.state_mb))
        # Per node, the agent's compile caches in a folder of their own, empty when the run starts.
        self.compile_caches = work / "compile-caches" if getattr(args, "compile_cache", "off") == "per-node" else None
        self.conf = {"join_timeout": "120s", "last_call_timeout": "1s", "keep_alive_interval": "1s",
                     "keep_alive_max_attempt": 3}
        self.config.write_text(yaml.safe_dump({
            "job": {"id": f"cluster-{os.getpid()}", "nnodes": f"{getattr(args, 'min_nodes', 1)}:{args.nodes}",
                    "nproc_per_node": args.nproc_per_node,
                    "max_restarts": getattr(args, "max_restarts", 5), "monitor_interval": 0.1},
            "rendezvous": {"backend": args.backend, "endpoint": args.rdzv_endpoint, "conf": self.conf},
            "checkpoint": {"dir": str(work / "checkpoints"), "interval_steps": args.interval_steps,
                           "keep": getattr(args, "keep_snapshots", 2), "memory_interval_steps": self.memory_interval,
                           "memory_dir": str(self.memory_dir) if self.memory_dir else None},
            "elastic": {"stop_grace": 2, "world_size_multiple_of": getattr(args, "multiple_of", 1),
                        "in_process": getattr(args, "in_process", False), **(self.workload.batch or {})},
            "compile": {"share": self.compile_caches is not None},
            "observability": {"event_log": str(self.events)},
        }))

    @property
    def script(self) -> str:  # type: ignore[override]  (the workload's, not a fixed one)
        return self.workload.script

    @property
    def width(self) -> int:
        """The MLP's hidden width (the chaos checks rebuild the model from it)."""
        if self.workload.width is None:
            raise ValueError(f"the {self.workload.name} workload has no MLP width")
        return self.workload.width

    def command(self, index: int) -> list[str]:
        local = [] if self.network is None else ["--local-addr", self.network.address(index)]
        if self.compile_caches is not None:
            local += ["--set", f"compile.cache_dir={self.compile_caches / f'node{index}'}"]
        command = [sys.executable, "-m", "launcher.cli", "run", "--config", str(self.config), *self._host_flag(index),
                   *local, self.workload.script, "--steps", str(getattr(self.args, "steps", 1_000_000)),
                   *self.workload.args, "--marks", str(self.marks), *getattr(self.args, "train_args", [])]
        if self.memory_dir is not None:
            command = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                       f'mount -t tmpfs -o size={self.memory_mb}m,mode=700 tmpfs {self.memory_dir} && exec "$@"', "sh",
                       *command]
        return command if self.network is None else self.network.wrap(index, command)

    @property
    def peer_config(self) -> dict[str, Any]:
        return {"rendezvous": self.args.backend, "rdzv_conf": self.conf, "stop_grace_s": 2,
                "liveness": "a TCP connection to every peer agent", "memory_interval_steps": self.memory_interval}

    def stop(self) -> None:
        super().stop()
        if self.memory_dir is not None:
            self.memory_dir.rmdir()  # only the mount point: each node's tmpfs went with its namespace

    def step_at(self, moment: float) -> int | None:
        """The last step rank 0 finished at or before ``moment`` (from the job's step marks)."""
        steps = [r["step"] for r in read_events(self.marks) if r["time"] <= moment] if self.marks.exists() else []
        return max(steps, default=None)

    def _host_flag(self, index: int) -> list[str]:
        """With c10d, node 0 hosts the store, whichever agent gets to the port first."""
        if self.args.backend != "c10d":
            return []
        return ["--rdzv-conf", f"is_host={'true' if index == 0 else 'false'}"]


class ClassicCluster(Nodes):
    """K plain torchrun agents training examples/classic_train.py (rank 0 torch.save, and on every
    (re)start torch.load + broadcast); its records are the script's marks. ``unshared_store`` sets
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, torch's switch that keeps workers off the rendezvous store
    (whose stale keys hang restarted gloo workers in torch 2.13)."""

    script = "examples/classic_train.py"
    log_prefix = "baseline"

    def __init__(self, args: argparse.Namespace, work: Path, endpoint: str, *, marks: Path | None = None,
                 unshared_store: bool = False, max_restarts: int = 5) -> None:
        env = {**job_env(), **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if unshared_store else {})}
        super().__init__(work, marks or work / "baseline-steps.jsonl", env)
        self.args = args
        self.endpoint = endpoint
        self.max_restarts = max_restarts
        self.marks = self.records

    def command(self, index: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{self.args.nodes}",
                f"--nproc-per-node={self.args.nproc_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id=baseline-{os.getpid()}", f"--max-restarts={self.max_restarts}",
                "--rdzv-conf=join_timeout=120", self.script, "--width", str(width_for(self.args.state_mb)),
                "--dir", str(self.work / "baseline-ckpt"), "--interval-steps", str(self.args.interval_steps),
                "--marks", str(self.marks), "--batch-size", str(per_rank_batch(self.args))]

    @property
    def peer_config(self) -> dict[str, Any]:
        return {"rendezvous": "c10d", "rdzv_conf": {"join_timeout": "120s", "last_call_timeout": "30s (torch's default)"},
                "max_restarts": self.max_restarts, "monitor_interval_s": "0.1 (torch's default)",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": self.env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "unset")}


def run_scenarios(args: argparse.Namespace, work: Path) -> list[dict]:
    cluster = Cluster(args, work)
    scenarios = args.scenario.split(",")
    initial = args.nodes - 1 if scenarios[0] == "join" else args.nodes
    results = []
    try:
        cluster.start_all(initial)
        # Every node started is in the round before the first fault: a node slower to start than
        # the first round's last call joins a round later, and the fault would hit a smaller job.
        cluster.wait_for(lambda ev: [e for e in ev if e["event"] == "rendezvous_done" and len(e["nodes"]) == initial],
                         args.timeout, f"a round of all {initial} nodes")
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
            split_compile(timeline, marks, fault_at)
            timeline["compile_cold_s"] = compile_cold_s(marks)
            events = read_events(cluster.events)
            timeline["compile_warm_from"] = compile_warm_from(events, fault_at)
            if scenario == "join":
                timeline["compile_joined_s"] = joined_compile_s(events, fault_at)
            results.append({"scenario": scenario, **timeline})
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


def training_gap(marks: list[dict], after: float) -> float | None:
    """How long the job trained no step around a fault at ``after``: from the last step rank 0
    finished before the recovered job's first step to that first step (None before it). For a
    kill it is about the recovery; for a join, whose new node starts while the job trains on, it
    is the job's own pause."""
    steps = sorted((m for m in marks if m["event"] in ("step", "first_step_done")), key=lambda m: m["time"])
    first = next((m for m in steps if m["event"] == "first_step_done" and m["time"] > after), None)
    before = [m["time"] for m in steps if first is not None and m["time"] < first["time"]]
    return first["time"] - before[-1] if before else None


def steady_step_s(marks: list[dict], before: float) -> float | None:
    """The median time between two of rank 0's steps before ``before`` (None with fewer than two)."""
    times = sorted(m["time"] for m in marks if m["event"] == "step" and m["time"] < before)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


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
    from peers_env import peers_python
    from torchft_cluster import TorchftCluster

    return TorchftCluster(args, work, marks=work / "marks.jsonl", peers_python=peers_python())


def _nvrx_baseline(args: argparse.Namespace, work: Path, unshared_store: bool) -> Nodes:
    from nvrx_cluster import NvrxCluster
    from peers_env import peers_python

    return NvrxCluster(args, work, marks=work / "marks.jsonl", peers_python=peers_python(), max_restarts=5)


BASELINES: dict[str, Callable[[argparse.Namespace, Path, bool], Nodes]] = {
    "torchrun": _torchrun_baseline, "torchft": _torchft_baseline, "nvrx": _nvrx_baseline}
"""--baseline choices: plain torchrun with the classic restore (examples/classic_train.py), and
the peers (scripts/torchft_cluster.py, scripts/nvrx_cluster.py), from their own environment."""


def _signal_tree(pid: int, sig: signal.Signals) -> None:
    """Signal a process and all its descendants (children first when stopping or killing, so
    that none is left to respawn or notice)."""
    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in tree:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants; the process is stopped first, so that it cannot
    start a new child between the listing of its tree and the kill."""
    _signal_tree(pid, signal.SIGSTOP)
    _signal_tree(pid, signal.SIGKILL)


def job_env() -> dict[str, str]:
    """The environment of launched jobs: the repo importable, one thread per process, no PET_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def soak(args: argparse.Namespace, work: Path) -> None:
    """--chaos: run the soak, write its report, exit 1 unless every invariant held."""
    from chaos import run_chaos

    with contextlib.ExitStack() as stack:
        result = run_in_network(args, work, stack, run_chaos)
    report = {"scenario": "chaos", "backend": args.backend, "nodes": args.nodes, "nproc_per_node": args.nproc_per_node,
              "state_bytes": workload_of(args).state_bytes, "seed": args.seed, "chaos": result,
              "work_dir": str(work) if args.keep else None}
    print(json.dumps({"invariants": result["invariants"], "ok": result["ok"]}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    raise SystemExit(0 if result["ok"] else 1)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_in_network(args: argparse.Namespace, work: Path, stack: contextlib.ExitStack,
                   run: Callable[[argparse.Namespace, Path], Any] = run_scenarios) -> Any:
    """The rendezvous service (an etcd this script starts, unless given) and, with --netns, the
    namespaces (removed when ``stack`` closes); then ``run`` (the scenarios, or the chaos soak)."""
    args.network = None
    host = "127.0.0.1"
    if args.netns:
        from netns import BRIDGE_ADDRESS, Network, NetnsError

        try:
            args.network = stack.enter_context(Network(args.nodes + 1))  # one spare for a joining node
        except NetnsError as exc:
            raise SystemExit(f"--netns: {exc}") from exc
        args.addresses = args.network.addresses[:args.nodes]
        host = BRIDGE_ADDRESS  # etcd listens on the bridge, reachable from every namespace
    if args.backend == "etcd3" and not args.rdzv_endpoint:
        from etcd_server import EtcdCluster, EtcdServer

        if "etcd-leader" in args.scenario.split(","):
            args.etcd_cluster = stack.enter_context(EtcdCluster(work / "etcd", 3, host=host))
            args.rdzv_endpoint = args.etcd_cluster.endpoint
        else:
            args.rdzv_endpoint = stack.enter_context(EtcdServer(work / "etcd-data", host=host)).endpoint
    if not args.rdzv_endpoint:
        args.rdzv_endpoint = f"{args.network.address(0) if args.network else '127.0.0.1'}:{free_port()}"
    return run(args, work)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked (an inconsistent one exits with argparse's usage error)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--scenario", default="kill")
    parser.add_argument("--fault-node", type=int, default=None, help="index of the node to fault (default: the last)")
    parser.add_argument("--backend", default="c10d")
    parser.add_argument("--rdzv-endpoint", default=None, help="default: a free port (c10d), or an etcd this script "
                        "starts (etcd3)")
    parser.add_argument("--workload", choices=WORKLOADS, default="mlp",
                        help="mlp: examples/train.py sized by --state-mb; gpt: examples/gpt/train.py (FSDP2)")
    parser.add_argument("--gpt-size", choices=sorted(GPT_SIZES), default="default", help="--workload gpt: the model")
    parser.add_argument("--compile", choices=("on", "off"), default="on", help="--workload gpt: torch.compile per block")
    parser.add_argument("--compile-cache", choices=("off", "per-node"), default="off",
                        help="per-node: each agent keeps its compile caches in a folder of its own, empty at the "
                             "start, and shares them through the checkpoint dir (compile.cache_dir, compile.share); "
                             "off: torch's default folder, one for every node of this machine")
    parser.add_argument("--state-mb", type=float, default=64, help="--workload mlp: the state's size")
    parser.add_argument("--interval-steps", type=int, default=5)
    parser.add_argument("--memory-interval", type=int, default=0, metavar="K",
                        help="a memory snapshot every K steps (the memory tier; 0: off); each node gets a tmpfs of "
                             "its own in a mount namespace of its own (root)")
    parser.add_argument("--memory-mb", type=int, default=None, help="each node's tmpfs size (default 4x --state-mb)")
    parser.add_argument("--baseline", nargs="?", const="torchrun", default=None, choices=sorted(BASELINES),
                        help="run the same fault on a baseline too (default torchrun with the classic restore)")
    parser.add_argument("--cap-s", type=float, default=120)
    parser.add_argument("--timeout", type=float, default=300, help="give up on any one wait after this long")
    parser.add_argument("--in-process", action="store_true",
                        help="survivors re-form in-process (elastic.in_process) instead of restarting their workers")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, events, checkpoints)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--netns", action="store_true", help="each node in a network namespace of its own (root)")
    parser.add_argument("--partition-s", type=float, default=15, help="partition: how long the link stays cut")
    parser.add_argument("--slow-s", type=float, default=20, help="slow-link, etcd-leader, cpu-hog: how long the job is watched")
    parser.add_argument("--slow-delay-ms", type=float, default=100)
    parser.add_argument("--slow-loss-pct", type=float, default=1)
    parser.add_argument("--store-host-wait-s", type=float, default=90,
                        help="store-host: how long to wait for a recovery before calling it none")
    parser.add_argument("--chaos", type=int, default=0, metavar="N",
                        help="chaos soak: N random faults into one job of --steps (scripts/chaos.py)")
    parser.add_argument("--seed", type=int, default=0, help="--chaos: the seed of the faults' RNG")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"the job's training steps (default: {CHAOS_STEPS} with --chaos, else 1,000,000)")
    args = parser.parse_args(argv)
    if args.steps is None:  # a soak's faults are drawn between 1/20 and 1/2 of its steps
        args.steps = CHAOS_STEPS if args.chaos else 1_000_000
    scenarios = args.scenario.split(",")
    if {"partition", "slow-link"} & set(scenarios) and not args.netns:
        parser.error("--scenario partition and slow-link need --netns")
    if "etcd-leader" in scenarios and args.backend != "etcd3":
        parser.error("--scenario etcd-leader needs --backend etcd3")
    if args.workload != "mlp" and (args.baseline or args.chaos):
        parser.error("--baseline and --chaos run --workload mlp only")
    if args.fault_node is None:
        args.fault_node = args.nodes - 1
    if args.backend == "c10d" and args.fault_node == 0 and args.scenario != "kill-worker":  # its agent lives on
        parser.error("--fault-node 0 hosts the c10d store: faulting it ends the job's rendezvous (use --backend etcd3)")
    return args


def main() -> None:
    args = parse_args()
    args.baseline_endpoint = f"127.0.0.1:{free_port()}"
    work = Path(tempfile.mkdtemp(prefix="torchrevive-cluster-"))
    # SIGTERM unwinds like SIGINT, so that every node is killed and every namespace removed.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if args.chaos:
        soak(args, work)
    with contextlib.ExitStack() as stack:
        runs = run_in_network(args, work, stack)
    workload = workload_of(args)
    report: dict[str, Any] = {"scenario": args.scenario, "backend": args.backend, "nodes": args.nodes,
                              "nproc_per_node": args.nproc_per_node, "workload": workload.name,
                              "params": workload.params, "state_bytes": workload.state_bytes,
                              "torchrevive": runs[0], "runs": runs, "work_dir": str(work) if args.keep else None}
    if args.netns:
        report["addresses"] = args.addresses
    if args.baseline:
        # torchrun twice: with torch's switch against its shared store (without it, new workers read
        # the dead round's peer addresses), the torchrun that recovers, and as it ships.
        scenario = args.scenario.split(",")[0]
        stores = ([("baseline", True), ("baseline_shared_store", False)] if args.baseline == "torchrun"
                  else [("baseline", False)])
        for key, unshared in stores:
            report[key] = base = run_baseline(args, work, scenario, args.baseline, unshared_store=unshared)
            shown = f"> {base['cap_s']:.0f} s (capped)" if base["capped"] else \
                f"{base['recovery_s']:.2f} s, pause {base['pause_s']:.2f} s"
            print(f"{key} ({args.baseline}{', torch shared store' if key == 'baseline_shared_store' else ''}): {shown}",
                  flush=True)
            if not base["capped"]:
                report[f"speedup_vs_{key}"] = base["recovery_s"] / runs[0]["recovery_s"]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        if (work / "events.jsonl").exists():  # the job's timeline beside its figures
            Path(args.json).with_suffix(".svg").write_text(draw_timeline(read_events(work / "events.jsonl")))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
