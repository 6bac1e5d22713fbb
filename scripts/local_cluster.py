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
checks the finished job against a fault-free reference (scripts/harness/chaos.py; JSON "chaos": {"faults",
"invariants", "ok"}; exit code 1 unless ok).
With --netns, each node runs in a network namespace of its own (scripts/harness/netns.py: addresses
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
peer instead (scripts/harness/torchft_cluster.py, scripts/harness/nvrx_cluster.py; their environment is made by
scripts/setup_peers.sh on first use).

`--memory-interval K` turns the memory tier on (a memory snapshot every K steps); each node then
mounts a tmpfs of its own (--memory-mb) at one path, in a mount namespace of its own (root).

JSON: {"scenario", "backend", "nodes", "nproc_per_node", "workload", "params", "state_bytes", "torchrevive": {"fault_at"
(the fault's wall-clock time, as the events' "time"), "recovery_s",
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
the fault), "resume_s" (recovery_s less one steady step); with --steps-after N, "new_world_step_s" (the median
of the N steps after the first at the new world size) and "resume_new_world_s" (recovery_s less that step: where a
step at the new world size takes longer or shorter than one before, as with 3 or 4 ranks sharing 2 cores, the
recovery's own time)}, "baseline": {"approach", "recovery_s" (from the
fault to the re-formed job's first step), "pause_s" (the longest time between two steps until then),
"capped", "cap_s", "peer_config"}}; with several scenarios, "runs" holds
one such torchrevive result per scenario; "machine". With --netns, "addresses" (one per node). A
network fault's run holds its checks, and "ok" when all hold.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.events import read_events
from agent.report_plot import draw_timeline
from harness.baselines import BASELINES, run_baseline
from harness.chaos import run_chaos
from harness.etcd_server import EtcdCluster, EtcdServer
from harness.machine import describe
from harness.netns import BRIDGE_ADDRESS, Network, NetnsError
from harness.ports import free_port
from harness.scenarios import run_scenarios
from harness.workloads import GPT_SIZES, WORKLOADS, workload_of

CHAOS_STEPS = 300
"""A chaos soak's steps unless --steps says otherwise: its faults fall between steps 15 and 150."""


def soak(args: argparse.Namespace, work: Path) -> None:
    """--chaos: run the soak, write its report, exit 1 unless every invariant held."""
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
        try:
            args.network = stack.enter_context(Network(args.nodes + 1))  # one spare for a joining node
        except NetnsError as exc:
            raise SystemExit(f"--netns: {exc}") from exc
        args.addresses = args.network.addresses[:args.nodes]
        host = BRIDGE_ADDRESS  # etcd listens on the bridge, reachable from every namespace
    if args.backend == "etcd3" and not args.rdzv_endpoint:
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
    parser.add_argument("--direct-io", choices=("on", "off"), default="on",
                        help="snapshot files written around the page cache (checkpoint.direct_io; on: its default) or "
                             "through it")
    parser.add_argument("--baseline", nargs="?", const="torchrun", default=None, choices=sorted(BASELINES),
                        help="run the same fault on a baseline too (default torchrun with the classic restore)")
    parser.add_argument("--cap-s", type=float, default=120)
    parser.add_argument("--timeout", type=float, default=300, help="give up on any one wait after this long")
    parser.add_argument("--steps-after", type=int, default=0, metavar="N",
                        help="after each recovery, wait for N more steps at the new world size and report their "
                             "median (new_world_step_s) and recovery_s less it (resume_new_world_s)")
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
                        help="chaos soak: N random faults into one job of --steps (scripts/harness/chaos.py)")
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
                              "torchrevive": runs[0], "runs": runs, "work_dir": str(work) if args.keep else None,
                              "machine": describe()}
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

