"""torchft 0.2.0 as a peer in the benchmarks: one replica group per node, each its own torchrun job
(--standalone: a c10d store of its own) training scripts/peers/torchft_train.py, and one Lighthouse
(started first, beside node 0) that forms each step's quorum; from the peers' virtual environment
(scripts/setup_peers.sh). A killed group's peers go on without it; a restarted one heals from a
live peer.

The configuration follows torchft 0.2.0's README, docs and train_ddp.py (its sdist):
  torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000
        README.md ("You can start a lighthouse server by running: RUST_BACKTRACE=1
        torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000"), and
        torchft/examples/slurm/README.md; --heartbeat_timeout_ms 1000, lowered from the
        Lighthouse's default of 5000 (src/lighthouse.rs; no doc recommends a value) for fast
        recovery: 10 of the Managers' 100 ms heartbeats, and the 1 s this project's own agents
        allow a heartbeat. A quorum that lost a member (no "fast quorum": not all of the previous
        quorum's members asked) waits for every group still heartbeating, up to join_timeout_ms:
        after a kill the survivors wait until the dead group's heartbeats are
        heartbeat_timeout_ms old, while a group that (re)joins delays no one
  torchrun --nnodes=1 --nproc_per_node=R --max_restarts=10 per group with TORCHFT_LIGHTHOUSE set,
        and the group's index and count (train_ddp.py's REPLICA_GROUP_ID / NUM_REPLICA_GROUPS, here
        flags): torchft/torchx.py (its hsdp component) and the README's two-group example; a free
        store port each (--standalone) instead of 29600 + i
  the Manager's, the process group's and the checkpoint transport's values: see
        scripts/peers/torchft_train.py (train_ddp.py's, else the Manager's defaults), which also
        says why its gradients go through Manager.allreduce and not train_ddp.py's
        torchft.ddp.DistributedDataParallel (whose comm hook kills every survivor of a peer's
        death on gloo)
Every value is in ``peer_config``. TORCHFT_* timeout variables in the caller's environment are
dropped, so that the values stated are the values in effect.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path
from typing import Any

from harness.nodes import REPO, Nodes, job_env, per_rank_batch
from harness.ports import free_port, wait_listening
from harness.workloads import width_for

LIGHTHOUSE = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 10000, "heartbeat_timeout_ms": 1000}
"""torchft_lighthouse's flags: the README's, and heartbeat_timeout_ms lowered for fast recovery."""
MANAGER = {"min_replica_size": 1, "timeout_s": 30, "quorum_timeout_s": 60, "connect_timeout_s": 60,
           "heartbeat_interval_ms": 100, "pg_timeout_s": 5, "transport_timeout_s": 10}
"""scripts/peers/torchft_train.py's flags (each with its source in that script's docstring)."""


class TorchftCluster(Nodes):
    """K torchft replica groups (one torchrun job each) training scripts/peers/torchft_train.py,
    and their Lighthouse; its records are replica group 0's marks (``marks``), the other groups'
    are work/torchft-marks<index>.jsonl."""

    script = "scripts/peers/torchft_train.py"
    log_prefix = "torchft"

    def __init__(self, args: argparse.Namespace, work: Path, *, marks: Path, peers_python: str,
                 max_restarts: int = 10) -> None:
        env = {k: v for k, v in job_env().items() if not k.startswith("TORCHFT_")}
        super().__init__(work, marks, env)
        self.args = args
        self.marks = marks
        self.bin = Path(peers_python).parent
        self.max_restarts = max_restarts
        self.lighthouse: subprocess.Popen | None = None
        self.batch_size = per_rank_batch(args) * args.nproc_per_node
        """Samples per replica group a step: the classic baseline's per rank, times the group's ranks."""

    def marks_of(self, index: int) -> Path:
        """Replica group ``index``'s step marks."""
        return self.marks if index == 0 else self.work / f"torchft-marks{index}.jsonl"

    def command(self, index: int) -> list[str]:
        manager = [arg for name in MANAGER if name != "min_replica_size"
                   for arg in (f"--{name.replace('_', '-')}", str(MANAGER[name]))]
        return [str(self.bin / "torchrun"), "--standalone", "--nnodes=1", f"--nproc-per-node={self.args.nproc_per_node}",
                f"--max-restarts={self.max_restarts}", self.script, "--replica-group", str(index),
                "--num-replica-groups", str(self.args.nodes), "--width", str(width_for(self.args.state_mb)),
                "--batch-size", str(self.batch_size), "--interval-steps", str(self.args.interval_steps),
                "--dir", str(self.work / "torchft-ckpt"), "--marks", str(self.marks_of(index)), *manager]

    def start_all(self, count: int) -> None:
        """Start the Lighthouse, wait until it listens, then nodes 0 .. count - 1."""
        port = free_port()
        log = open(self.work / f"{self.log_prefix}-lighthouse.log", "a")  # noqa: SIM115 (open for its lifetime)
        self.lighthouse = subprocess.Popen(
            [str(self.bin / "torchft_lighthouse"), "--bind", f"127.0.0.1:{port}",
             *(arg for name, value in LIGHTHOUSE.items() for arg in (f"--{name}", str(value)))],
            cwd=REPO, env={**self.env, "RUST_BACKTRACE": "1"}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        wait_listening(self.lighthouse, "127.0.0.1", port, name="torchft_lighthouse", log=Path(log.name))
        self.env["TORCHFT_LIGHTHOUSE"] = f"http://127.0.0.1:{port}"
        super().start_all(count)

    def stop(self) -> None:
        """Kill every node, then the Lighthouse."""
        super().stop()
        if self.lighthouse is not None:
            self.lighthouse.kill()
            self.lighthouse.wait()
            self.lighthouse = None

    @property
    def peer_config(self) -> dict[str, Any]:
        return {
            "torchft": "0.2.0", "launcher": "torchrun --standalone --nnodes=1 per replica group (a job and c10d "
            f"store of its own), --max-restarts={self.max_restarts} (torchft/torchx.py's default)",
            "replica_groups": self.args.nodes, "ranks_per_group": self.args.nproc_per_node,
            "batch_size_per_group": self.batch_size,
            "lighthouse": {**LIGHTHOUSE, "source": "README.md's torchft_lighthouse command line; heartbeat_timeout_ms: "
                           "lowered from the Lighthouse's default 5000 (src/lighthouse.rs) for fast recovery"},
            "manager": {**MANAGER, "use_async_quorum": True, "init_sync": True, "quorum_retries": 0,
                        "max_retries": None, "world_size_mode": "DYNAMIC",
                        "source": "timeout_s, pg_timeout_s, transport_timeout_s: train_ddp.py; the others: "
                                  "torchft.Manager's defaults (see scripts/peers/torchft_train.py)"},
            "process_group": "torchft.ProcessGroupGloo", "checkpoint_transport": "PGTransport (as train_ddp.py)",
            "ddp": "manual: Manager.allreduce of the gradients (one flat bucket) + torchft.optim.OptimizerWrapper "
                   "(should_commit); not train_ddp.py's torchft.ddp.DistributedDataParallel, whose comm hook fails "
                   "`assert fut._fut` in every survivor when a peer dies mid all-reduce on gloo (torchft 0.2.0), "
                   "see scripts/peers/torchft_train.py",
            "on_peer_loss": "the survivors' step is discarded (all-reduce error), the next quorum forms without the "
                            "dead group once its heartbeats are heartbeat_timeout_ms old",
            "checkpoint": f"replica group 0's rank 0 torch.save every {self.args.interval_steps} steps; never read "
                          "(a restarted group heals from a live peer)",
        }
