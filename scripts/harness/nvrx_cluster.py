"""NVIDIA's nvidia-resiliency-ext 0.4.1 as a peer in the benchmarks: one `ft_launcher` per node
(its torchrun-based launcher with in-job restarts and a rank monitor per rank) training
scripts/peers/nvrx_train.py (examples/classic_train.py's job plus nvrx's heartbeats), from the
peers' virtual environment (scripts/setup_peers.sh).

The command line follows nvrx 0.4.1's docs and examples (its repository at tag v0.4.1):
  elastic c10d rendezvous, store on node 0  launcher.py's torchrun docstring ("Elastic (min=1,
        max=4 ...)": --nnodes=1:4 --max-restarts --rdzv-id --rdzv-backend=c10d --rdzv-endpoint),
        and tests/fault_tolerance/func/run_launcher_any_failed_mode_test.sh, which starts several
        agents on one host with --rdzv-conf is_host=1 for the store's and is_host=0 for the others;
        c10d is the only backend ft_launcher 0.4.1 takes, and it swaps in its own rendezvous
        (_ft_rendezvous.FtRendezvousHandler: torch's dynamic rendezvous plus node health checks
        and spare nodes)
  --ft-restart-policy=any-failed  the default; usage_guide.rst: all workers restart when any fails
  --ft-initial-rank-heartbeat-timeout=30 --ft-rank-heartbeat-timeout=15  the timeouts until the
        worker calculates its own: examples/fault_tolerance/basic_ft_example.py's command line
  heartbeats every step, timeouts calculated from observed intervals once a save was seen:
        docs/source/fault_tolerance/integration/heartbeats.rst (see scripts/peers/nvrx_train.py)
  --rdzv-conf last_call_timeout=1  lowered from torch's 30 s for fast recovery (LAST_CALL_S)
Everything else is ft_launcher's default, listed in ``peer_config``.

TORCH_DISABLE_SHARE_RDZV_TCP_STORE is not needed (and is not read): ft_launcher runs its own copy
of torch 2.3's elastic agent (nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat), which
never hands the rendezvous store to the workers: every round, group rank 0's agent picks a free
MASTER_PORT and rank 0's worker hosts a new store there (TORCHELASTIC_USE_AGENT_STORE=False).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from harness.nodes import Nodes, job_env, per_rank_batch
from harness.ports import free_port
from harness.workloads import width_for

LAST_CALL_S = 1
"""The rendezvous' last call, lowered from torch's 30 s (ft_launcher's default; its docs recommend no
value) for fast recovery: the 1 s torchrevive's own jobs use in these benchmarks."""
HEARTBEAT_TIMEOUTS = {"initial_rank_heartbeat_timeout": 30.0, "rank_heartbeat_timeout": 15.0}
"""Every (re)start's, until its workers calculate theirs: examples/fault_tolerance/basic_ft_example.py's
command line. The initial one bounds a restart's init, checkpoint load and broadcast, and first step."""


class NvrxCluster(Nodes):
    """K `ft_launcher` agents (nvidia-resiliency-ext 0.4.1) training scripts/peers/nvrx_train.py:
    in-job restarts of every worker when any fails or a node leaves or joins, c10d rendezvous on
    node 0, rank 0 torch.save / torch.load + broadcast; its records are the script's marks."""

    script = "scripts/peers/nvrx_train.py"
    log_prefix = "nvrx"

    def __init__(self, args: argparse.Namespace, work: Path, *, marks: Path, peers_python: str,
                 max_restarts: int) -> None:
        super().__init__(work, marks, job_env())
        self.args = args
        self.marks = marks
        self.launcher = str(Path(peers_python).parent / "ft_launcher")
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.max_restarts = max_restarts
        self.batch_size = per_rank_batch(args)
        self.killed: set[int] = set()
        """The pids of every killed node's processes, whose IPC sockets stop() removes."""

    def command(self, index: int) -> list[str]:
        return [self.launcher, f"--nnodes=1:{self.args.nodes}", f"--nproc-per-node={self.args.nproc_per_node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id=nvrx-{os.getpid()}",
                f"--rdzv-conf=is_host={1 if index == 0 else 0},last_call_timeout={LAST_CALL_S}",
                f"--max-restarts={self.max_restarts}",
                "--ft-restart-policy=any-failed",
                *(f"--ft-{name.replace('_', '-')}={value}" for name, value in HEARTBEAT_TIMEOUTS.items()),
                self.script, "--width", str(width_for(self.args.state_mb)), "--dir", str(self.work / "nvrx-ckpt"),
                "--interval-steps", str(self.args.interval_steps), "--marks", str(self.marks),
                "--batch-size", str(self.batch_size)]

    def kill(self, index: int) -> None:
        self.killed |= self.pids(index)
        super().kill(index)

    def stop(self) -> None:
        """Kill every node, then remove the IPC sockets (/tmp/_ft_launcher<pid>*.socket) that its
        launchers and rank monitors, killed, left behind."""
        for index in self.nodes:
            self.killed |= self.pids(index)
        super().stop()
        for pid in self.killed:
            for path in [*Path(tempfile.gettempdir()).glob(f"_ft_launcher{pid}.*"),
                         *Path(tempfile.gettempdir()).glob(f"_ft_launcher{pid}_*")]:
                path.unlink(missing_ok=True)

    @property
    def peer_config(self) -> dict[str, Any]:
        return {
            "launcher": "ft_launcher (nvidia-resiliency-ext 0.4.1)", "rendezvous": "c10d (nvrx's FtRendezvousHandler)",
            "nnodes": f"1:{self.args.nodes}", "max_restarts": self.max_restarts, "restart_policy": "any-failed",
            "rdzv_conf": {"join_timeout": "900s", "last_call_timeout": f"{LAST_CALL_S}s", "close_timeout": "600s",
                          "read_timeout": "600s", "source": "ft_launcher's defaults (LaunchConfig, RendezvousTimeout), "
                          "but last_call_timeout, lowered from 30s for fast recovery"},
            "rdzv_keep_alive": {"interval_s": 5, "max_attempt": 3,
                                "source": "fixed in ft_launcher 0.4.1 (FtRendezvousHandler.from_backend)"},
            "monitor_interval_s": 0.1, "workers_stop_timeout_s": 30,
            "heartbeats": {
                **HEARTBEAT_TIMEOUTS, "until": "calculated by the workers",
                "source": "examples/fault_tolerance/basic_ft_example.py's command line",
                "sent": "after every step", "calculated": "calculate_and_set_hb_timeouts() at the step after each "
                "(re)start's first save: observed max intervals (max over ranks) x safety_factor",
                "safety_factor": 5.0, "workload_check_interval_s": 5.0, "rank_termination_signal": "SIGKILL",
                "kept_across_restarts": False,
                "guide": "docs/source/fault_tolerance/integration/heartbeats.rst"},
            "node_health_check": {"gpu": "before every rendezvous join and every 5 s (node_health_check_interval); "
                                  "off without an NVIDIA driver", "nic_monitor": "on (default); no InfiniBand here"},
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "not needed: nvrx's agent never shares its rendezvous store",
        }
