"""Fault-injection harness: K `torchrevive run` agents ("nodes") on 127.0.0.1 training
examples/train.py with a state of a chosen size; once training is steady (a snapshot committed),
a fault is injected and the recovery is timed from the job's event log.

    python scripts/local_cluster.py --nodes 4 --nproc-per-node 1 --scenario kill --state-mb 512 \\
        --baseline --json out.json

Scenarios (several, comma-separated, run in sequence on the same job):
  kill         SIGKILL a node (its agent and workers)
  freeze       SIGSTOP a node; it is thawed (SIGCONT) after the others recovered, and rejoins
  join         a node starts (the job starts with one node fewer) and the job grows
  kill-worker  SIGKILL one worker process of a node
  kill-during-save     SIGKILL a node while an async save is being written
  kill-during-restore  SIGKILL a node, then another while the survivors restore
Node 0 is started first and hosts the c10d store; the fault hits node --fault-node (default the
last). `--baseline` runs the same scenario with plain torchrun and the classic restore (rank 0
torch.load + broadcast, examples/classic_train.py), capped at --cap-s.

JSON: {"scenario", "backend", "nodes", "nproc_per_node", "state_bytes", "torchrevive": {"recovery_s",
"world_size_before", "world_size_after", "phases": {detect, rendezvous, workers_start, restore,
first_step}}, "baseline": {"recovery_s", "capped", "cap_s"}}; with several scenarios, "runs" holds
one such torchrevive result per scenario.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml
from local_ports import free_port

from agent.events import read_events
from agent.recovery_timeline import recovery_after

REPO = Path(__file__).resolve().parents[1]
SQUARE_LAYERS = 2
"""examples/train.py's MLP: 64 -> W, then two W x W layers, then W -> 8."""


def width_for(state_mb: float) -> int:
    """The example MLP's hidden width whose parameters + Adam moments take about ``state_mb`` MB."""
    params = state_mb * 1e6 / (3 * 4)
    return max(64, int(math.sqrt(params / SQUARE_LAYERS)))


def state_bytes(width: int) -> int:
    """Parameters and Adam's two moments, float32."""
    params = 64 * width + width + SQUARE_LAYERS * (width * width + width) + width * 8 + 8
    return params * 4 * 3


class Cluster:
    """K agents of one job, each in its own session so that a node's agent and workers are
    signalled together."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.events = work / "events.jsonl"
        self.width = width_for(args.state_mb)
        self.nodes: dict[int, subprocess.Popen] = {}
        self.config = work / "job.yaml"
        conf = {"join_timeout": "120s", "last_call_timeout": "1s", "keep_alive_interval": "1s",
                "keep_alive_max_attempt": 3}
        self.config.write_text(yaml.safe_dump({
            "job": {"id": f"cluster-{os.getpid()}", "nnodes": f"1:{args.nodes}", "nproc_per_node": args.nproc_per_node,
                    "max_restarts": 5, "monitor_interval": 0.1},
            "rendezvous": {"backend": args.backend, "endpoint": args.rdzv_endpoint, "conf": conf},
            "checkpoint": {"dir": str(work / "checkpoints"), "interval_steps": args.interval_steps, "keep": 2},
            "elastic": {"stop_grace": 2, "world_size_multiple_of": getattr(args, "multiple_of", 1)},
            "observability": {"event_log": str(self.events)},
        }))

    def start(self, index: int) -> None:
        log = open(self.work / f"node{index}.log", "w")  # noqa: SIM115 (open for the node's lifetime)
        self.nodes[index] = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "run", "--config", str(self.config), *self._host_flag(index),
             "examples/train.py",
             "--steps", str(getattr(self.args, "steps", 1_000_000)), "--width", str(self.width),
             *getattr(self.args, "train_args", [])],
            cwd=REPO, env=job_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def _host_flag(self, index: int) -> list[str]:
        """With c10d, node 0 hosts the store, whichever agent gets to the port first."""
        if self.args.backend != "c10d":
            return []
        return ["--rdzv-conf", f"is_host={'true' if index == 0 else 'false'}"]

    def signal(self, index: int, sig: signal.Signals) -> None:
        """Signal a node: its agent and every worker (torch starts workers in sessions of their own)."""
        _signal_tree(self.nodes[index].pid, sig)

    def kill_worker(self, index: int) -> None:
        workers = [p for p in psutil.Process(self.nodes[index].pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())]
        workers[-1].kill()

    def wait_done(self, timeout: float) -> list[int]:
        """Wait for every node's agent to exit (a job with a finite --steps); their exit codes."""
        deadline = time.time() + timeout
        return [proc.wait(timeout=max(1.0, deadline - time.time())) for proc in self.nodes.values()]

    def stop(self) -> None:
        for proc in self.nodes.values():
            _signal_tree(proc.pid, signal.SIGCONT)
            _signal_tree(proc.pid, signal.SIGKILL)
            proc.wait()

    def wait_for(self, predicate, timeout: float, what: str) -> Any:
        deadline = time.time() + timeout
        while time.time() < deadline:
            events = read_events(self.events) if self.events.exists() else []
            found = predicate(events)
            if found:
                return found
            time.sleep(0.2)
        raise TimeoutError(f"no {what} within {timeout:.0f} s; see the node logs in {self.work}")


def run_scenarios(args: argparse.Namespace, work: Path) -> list[dict]:
    cluster = Cluster(args, work)
    scenarios = args.scenario.split(",")
    initial = args.nodes - 1 if scenarios[0] == "join" else args.nodes
    results = []
    try:
        for index in range(initial):
            cluster.start(index)
            time.sleep(0.5 if index == 0 else 0.1)  # node 0 binds the c10d store first
        for scenario in scenarios:
            since = time.time()
            cluster.wait_for(lambda ev, t=since: [e for e in ev if e["event"] == "save_committed" and e["time"] > t],
                             args.timeout, "committed snapshot")
            fault = args.fault_node if args.fault_node in cluster.nodes else max(cluster.nodes)
            if scenario == "kill-during-save":  # while an async save is being written
                waiting = time.time()
                cluster.wait_for(lambda ev, t=waiting: [e for e in ev if e["event"] == "save_started" and e["time"] > t],
                                 args.timeout, "an async save")
            else:
                time.sleep(1.0)
            fault_at = time.time()
            if scenario in ("kill", "kill-during-save", "kill-during-restore"):
                cluster.signal(fault, signal.SIGKILL)
                cluster.nodes.pop(fault).wait()
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
                second = max(cluster.nodes)
                cluster.signal(second, signal.SIGKILL)
                cluster.nodes.pop(second).wait()
            timeline = cluster.wait_for(lambda ev, t=fault_at: recovery_after(ev, t, failed_at=t), args.timeout,
                                        f"recovery after {scenario}")
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


def run_baseline(args: argparse.Namespace, work: Path, scenario: str, *, unshared_store: bool = False) -> dict:
    """The same fault on plain torchrun with the classic restore; recovery capped at --cap-s.
    ``unshared_store`` sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, torch's switch that keeps workers
    off the rendezvous store (whose stale keys hang restarted gloo workers in torch 2.13)."""
    work = work / ("baseline-unshared" if unshared_store else "baseline")
    work.mkdir(parents=True, exist_ok=True)
    marks = work / "baseline-steps.jsonl"
    env = {**job_env(), **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if unshared_store else {})}
    width = width_for(args.state_mb)
    procs = []
    initial = args.nodes - 1 if scenario == "join" else args.nodes

    def start(index: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{args.nodes}",
             f"--nproc-per-node={args.nproc_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.baseline_endpoint}",
             f"--rdzv-id=baseline-{os.getpid()}", "--max-restarts=5", "--rdzv-conf=join_timeout=120",
             "examples/classic_train.py", "--width", str(width), "--dir", str(work / "baseline-ckpt"),
             "--interval-steps", str(args.interval_steps), "--marks", str(marks)],
            cwd=REPO, env=env, stdout=open(work / f"baseline{index}.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True,
        )

    def marks_after(t: float) -> list[dict]:
        return [m for m in (read_events(marks) if marks.exists() else []) if m["time"] > t]

    try:
        for index in range(initial):
            procs.append(start(index))
            time.sleep(0.5 if index == 0 else 0.1)
        deadline = time.time() + args.timeout
        while not any(m["event"] == "saved" for m in marks_after(0)):
            if time.time() > deadline:
                raise TimeoutError(f"baseline: no checkpoint within {args.timeout:.0f} s; see {work}/baseline*.log")
            time.sleep(0.2)
        time.sleep(1.0)
        fault_at = time.time()
        victim = procs[min(args.fault_node, len(procs) - 1)]
        if scenario == "kill":
            _signal_tree(victim.pid, signal.SIGKILL)
        elif scenario == "freeze":
            _signal_tree(victim.pid, signal.SIGSTOP)
        elif scenario == "join":
            procs.append(start(len(procs)))
        elif scenario == "kill-worker":
            [p for p in psutil.Process(victim.pid).children(recursive=True) if "classic_train" in " ".join(p.cmdline())][-1].kill()
        while time.time() < fault_at + args.cap_s:
            resumed = [m for m in marks_after(fault_at) if m["event"] == "first_step_done"]
            if resumed:
                return {"recovery_s": resumed[0]["time"] - fault_at, "capped": False, "cap_s": args.cap_s}
            time.sleep(0.2)
        return {"recovery_s": None, "capped": True, "cap_s": args.cap_s}
    finally:
        for proc in procs:
            _signal_tree(proc.pid, signal.SIGCONT)
            _signal_tree(proc.pid, signal.SIGKILL)
            proc.wait()


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


def job_env() -> dict[str, str]:
    """The environment of launched jobs: the repo importable, one thread per process, no PET_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--scenario", default="kill")
    parser.add_argument("--fault-node", type=int, default=None, help="index of the node to fault (default: the last)")
    parser.add_argument("--backend", default="c10d")
    parser.add_argument("--rdzv-endpoint", default=None, help="default: a free port (c10d), or an etcd this script "
                        "starts (etcd3)")
    parser.add_argument("--state-mb", type=float, default=64)
    parser.add_argument("--interval-steps", type=int, default=5)
    parser.add_argument("--baseline", action="store_true")
    parser.add_argument("--baseline-unshared-store", action="store_true",
                        help="also run the baseline with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    parser.add_argument("--cap-s", type=float, default=120)
    parser.add_argument("--timeout", type=float, default=300, help="give up on any one wait after this long")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, events, checkpoints)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.fault_node is None:
        args.fault_node = args.nodes - 1
    if args.backend == "c10d" and args.fault_node == 0:
        parser.error("--fault-node 0 hosts the c10d store: faulting it ends the job's rendezvous (use --backend etcd3)")
    args.baseline_endpoint = f"127.0.0.1:{free_port()}"
    work = Path(tempfile.mkdtemp(prefix="torchrevive-cluster-"))
    with contextlib.ExitStack() as stack:
        if args.backend == "etcd3" and not args.rdzv_endpoint:
            from etcd_server import EtcdServer

            args.rdzv_endpoint = stack.enter_context(EtcdServer(work / "etcd-data")).endpoint
        args.rdzv_endpoint = args.rdzv_endpoint or f"127.0.0.1:{free_port()}"
        runs = run_scenarios(args, work)
    report: dict[str, Any] = {"scenario": args.scenario, "backend": args.backend, "nodes": args.nodes,
                              "nproc_per_node": args.nproc_per_node, "state_bytes": state_bytes(width_for(args.state_mb)),
                              "torchrevive": runs[0], "runs": runs, "work_dir": str(work) if args.keep else None}
    if args.baseline:
        report["baseline"] = run_baseline(args, work, args.scenario.split(",")[0])
        base = report["baseline"]
        shown = f"> {base['cap_s']:.0f} s (capped)" if base["capped"] else f"{base['recovery_s']:.2f} s"
        print(f"baseline (torchrun + rank-0 torch.load + broadcast): {shown}", flush=True)
        if not base["capped"]:
            report["speedup_vs_baseline"] = base["recovery_s"] / runs[0]["recovery_s"]
        if args.baseline_unshared_store:
            report["baseline_unshared_store"] = other = run_baseline(args, work, args.scenario.split(",")[0],
                                                                     unshared_store=True)
            shown = f"> {other['cap_s']:.0f} s (capped)" if other["capped"] else f"{other['recovery_s']:.2f} s"
            print(f"baseline with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: {shown}", flush=True)
            if not other["capped"]:
                report["speedup_vs_baseline_unshared_store"] = other["recovery_s"] / runs[0]["recovery_s"]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
