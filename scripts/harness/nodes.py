"""A local job's node processes: K "nodes" on this machine, each a process tree in a session of
its own (so that a node's agent and workers are signalled together), launched as `torchrevive run`
agents (:class:`Cluster`) or plain torchrun (:class:`ClassicCluster`); the peers' launchers are in
:mod:`harness.torchft_cluster` and :mod:`harness.nvrx_cluster`."""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import yaml

from agent.events import read_events
from harness.workloads import width_for, workload_of

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 48
"""examples/train.py's samples per step (--global-batch-size), at every world size."""


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

    def wait_for_round_of(self, count: int, timeout: float) -> list[dict]:
        """Wait for a round of ``count`` nodes (its rendezvous_done events): a node slower to start
        than the first round's last call joins a round later, and a fault before would hit a smaller job."""
        return self.wait_for(lambda ev: [e for e in ev if e["event"] == "rendezvous_done" and len(e["nodes"]) == count],
                             timeout, f"a round of all {count} nodes")

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
            from harness.netns import LINK

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
        self.conf = {"join_timeout": f"{getattr(args, 'join_timeout_s', 120):g}s", "last_call_timeout": "1s",
                     "keep_alive_interval": "1s", "keep_alive_max_attempt": 3}
        self.config.write_text(yaml.safe_dump({
            "job": {"id": f"cluster-{os.getpid()}", "nnodes": f"{getattr(args, 'min_nodes', 1)}:{args.nodes}",
                    "nproc_per_node": args.nproc_per_node,
                    "max_restarts": getattr(args, "max_restarts", 5), "monitor_interval": 0.1},
            "rendezvous": {"backend": args.backend, "endpoint": args.rdzv_endpoint, "conf": self.conf},
            "checkpoint": {"dir": str(work / "checkpoints"), "interval_steps": args.interval_steps,
                           "keep": getattr(args, "keep_snapshots", 2), "memory_interval_steps": self.memory_interval,
                           "memory_dir": str(self.memory_dir) if self.memory_dir else None,
                           "direct_io": getattr(args, "direct_io", "on") == "on"},
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
                "liveness": "a TCP connection to every peer agent", "memory_interval_steps": self.memory_interval,
                "direct_io": getattr(self.args, "direct_io", "on") == "on"}

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
