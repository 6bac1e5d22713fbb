"""A model of recovery time after a node loss, by phase, for three ways of bringing a job back:

  classic      torchrun defaults; rank 0 `torch.load`s the whole checkpoint (one reader stream,
               unpickling) and broadcasts every tensor to the other ranks;
  parallel     torchrun defaults; every rank reads its own shard in parallel, torchsnapshot-style
               (each chunk read into a buffer and copied again: a fraction of the storage speed);
  torchrevive  a killed agent seen from its closed connection (a hang from its heartbeats),
               re-rendezvous without the last-call wait, workers forked from a warm process
               (then process-group init and model build), node prefetch during worker start,
               sharded reads at storage speed, replicated state read once per cluster (striped)
               and exchanged over the network (or, --no-stripe-replicated, read whole by every rank).

    python scripts/simulate_scale.py --gpus 512 --size-tb 1 --json out.json

Every figure the model uses is an assumption printed with the result (override with flags);
scripts/calibrate_scale.py checks the same model against what this machine measures.
JSON: {"assumptions": {...}, "approaches": {NAME: {"total_s", "phases": {PHASE: s}, "bound_by"}}}.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

PHASES = ("detect", "rendezvous", "workers_start", "restore", "first_step")


@dataclass
class Assumptions:
    """Cluster, storage and software figures (GB = 1e9 bytes). Defaults: a 512-GPU cluster of 64
    nodes x 8 GPUs on a parallel filesystem; see docs/scale.md for where each figure comes from."""

    gpus: int = 512
    gpus_per_node: int = 8
    size_bytes: float = 1e12
    replicated_fraction: float = 0.0
    """Part of the state every data-parallel rank holds whole (0 for FSDP/ZeRO-3)."""
    stripe_replicated: bool = True
    """torchrevive reads replicated state once per cluster and exchanges the stripes, as a job
    configured with `restore.replicated: stripe` does (what the figures at scale assume); False:
    every rank reads it whole, as with the config's default, `all`."""
    storage_aggregate_gbps: float = 200.0
    """Parallel filesystem aggregate read bandwidth."""
    client_gbps: float = 10.0
    """What one node can read from it (client and NIC limits)."""
    stream_gbps: float = 0.6
    """One reader stream: torch.load of a pickle, single-threaded."""
    nic_gbps: float = 40.0
    """Per-node network bandwidth for broadcasts (400 Gb/s NIC at ~80% efficiency)."""
    parallel_efficiency: float = 0.25
    """torchsnapshot-style restore speed as a fraction of the storage speed (read into buffers,
    copied twice): measured 0.23-0.28 on this project's machine, cold."""
    torchrevive_efficiency: float = 1.0
    """torchrevive's restore speed as a fraction of the storage speed: measured 1.0 cold."""
    page_cache_warm: float = 0.0
    """Fraction of a node's share already in its page cache (0: a replacement node, cold)."""
    memory_gbps: float = 20.0
    """Page-cache-to-tensor copy speed per node (warm reads)."""
    worker_start_s: float = 20.0
    """A cold worker start at this scale: process start, imports, NCCL init and model build."""
    warm_fork_s: float = 0.05
    """A worker forked from the agent's warm process (torch and the job's modules imported)."""
    process_group_init_s: float = 5.0
    """NCCL communicator init of every rank at this scale, once the processes run."""
    model_build_s: float = 2.0
    """Building the model on the device without initializing it (meta device, to_empty)."""
    liveness_detect_s: float = 0.2
    """After a kill: until a survivor's liveness connection to the dead agent closes and the loss
    is acted on."""
    first_step_s: float = 5.0
    keep_alive_s: float = 1.0
    keep_alive_attempts: int = 3
    rejoin_polls: int = 3
    """State reads a re-rendezvous waits for (leave the round, join the next, see it complete):
    torchrevive's nodes read every keep_alive_interval / 10, and a round completes once every live
    node joined, without torch's last call."""
    failure_seen_s: float = 1.0
    """After a kill: until the peers' collectives fail and their agents see it."""
    torchrun_keep_alive_s: float = 5.0
    torchrun_last_call_s: float = 30.0
    rendezvous_s: float = 2.0
    """A rendezvous round's own work (store round trips) with nothing to wait for."""
    failure: str = "kill"
    """kill (peers see connection errors) or hang (peers block in a collective)."""
    collective_timeout_s: float = 1800.0
    """torch's default process-group timeout: how long a hang blocks the survivors under torchrun."""

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node


def read_s(nbytes_per_node: float, a: Assumptions, efficiency: float, nodes_reading: int) -> float:
    """Time for every reading node to read its bytes: bound by the client or the aggregate."""
    cold = nbytes_per_node * (1 - a.page_cache_warm)
    warm = nbytes_per_node * a.page_cache_warm
    per_node_gbps = min(a.client_gbps, a.storage_aggregate_gbps / max(1, nodes_reading)) * efficiency
    return cold / (per_node_gbps * 1e9) + warm / (a.memory_gbps * 1e9)


def classic(a: Assumptions) -> dict[str, float]:
    detect = a.collective_timeout_s if a.failure == "hang" else a.failure_seen_s
    read = a.size_bytes / (min(a.stream_gbps, a.client_gbps) * 1e9)
    broadcast = a.size_bytes / (a.nic_gbps * 1e9)  # pipelined ring/tree broadcast from rank 0's node
    return {"detect": detect, "rendezvous": a.torchrun_last_call_s + a.rendezvous_s,
            "workers_start": a.worker_start_s, "restore": read + broadcast, "first_step": a.first_step_s}


def parallel(a: Assumptions) -> dict[str, float]:
    detect = a.collective_timeout_s if a.failure == "hang" else a.failure_seen_s
    nodes = a.nodes - 1
    sharded = a.size_bytes * (1 - a.replicated_fraction) / nodes
    replicated = a.size_bytes * a.replicated_fraction  # every rank reads all of it
    restore = read_s(sharded + replicated * a.gpus_per_node, a, a.parallel_efficiency, nodes)
    return {"detect": detect, "rendezvous": a.torchrun_last_call_s + a.rendezvous_s,
            "workers_start": a.worker_start_s, "restore": restore, "first_step": a.first_step_s}


def torchrevive_worker_start_s(a: Assumptions) -> float:
    """Workers forked warm, then their process group and model."""
    return a.warm_fork_s + a.process_group_init_s + a.model_build_s


def torchrevive(a: Assumptions) -> dict[str, float]:
    # A killed agent's connections close at once and it is dropped from the round for every node.
    # A hung one is found when its last heartbeat, on average half an interval before it hung, is
    # keep_alive x attempts old, by a watch reading the state every keep_alive / 4 (half that on
    # average). Then the round takes a few polls of the state.
    heartbeat_lapse = a.keep_alive_s * a.keep_alive_attempts - a.keep_alive_s / 2
    detect = heartbeat_lapse + a.keep_alive_s / 8 if a.failure == "hang" else a.liveness_detect_s
    rendezvous = a.rejoin_polls * a.keep_alive_s / 10 + a.rendezvous_s
    workers_start = torchrevive_worker_start_s(a)
    nodes = a.nodes - 1
    sharded = a.size_bytes * (1 - a.replicated_fraction) / nodes
    replicated = a.size_bytes * a.replicated_fraction
    if a.stripe_replicated:  # read once per cluster, a stripe per node, then exchanged
        own, exchange = sharded + replicated / nodes, replicated / (a.nic_gbps * 1e9)
    else:  # every rank reads it whole
        own, exchange = sharded + replicated * a.gpus_per_node, 0.0
    read = read_s(own, a, a.torchrevive_efficiency, nodes)
    # The agent prefetches the node's share while the workers start; the restore then copies from
    # the page cache what arrived and reads the rest.
    prefetched = min(read, workers_start)
    copy = own * (prefetched / read if read else 0) / (a.memory_gbps * 1e9)
    restore = read - prefetched + copy + exchange
    return {"detect": detect, "rendezvous": rendezvous, "workers_start": workers_start, "restore": restore,
            "first_step": a.first_step_s}


APPROACHES = {"classic": classic, "parallel": parallel, "torchrevive": torchrevive}


def simulate(a: Assumptions) -> dict:
    approaches = {}
    for name, model in APPROACHES.items():
        phases = model(a)
        approaches[name] = {"total_s": sum(phases.values()), "phases": phases,
                            "bound_by": max(phases, key=phases.get)}
    return {"assumptions": {**asdict(a), "nodes": a.nodes}, "approaches": approaches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-tb", type=float, default=1.0)
    for f in fields(Assumptions):
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name != "size_bytes":
            parser.add_argument(flag, type=type(f.default), default=f.default)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    values = {f.name: getattr(args, f.name) for f in fields(Assumptions) if f.name != "size_bytes"}
    result = simulate(Assumptions(size_bytes=args.size_tb * 1e12, **values))
    a = result["assumptions"]
    print(f"{a['gpus']} GPUs ({a['nodes']} nodes x {a['gpus_per_node']}), {a['size_bytes'] / 1e12:g} TB state, "
          f"failure: {a['failure']}; storage {a['storage_aggregate_gbps']:g} GB/s aggregate, "
          f"{a['client_gbps']:g} GB/s per node, NIC {a['nic_gbps']:g} GB/s")
    print(f"{'approach':12s} " + " ".join(f"{p:>13s}" for p in PHASES) + f" {'total':>10s}  bound by")
    for name, r in result["approaches"].items():
        print(f"{name:12s} " + " ".join(f"{r['phases'][p]:12.1f}s" for p in PHASES)
              + f" {r['total_s']:9.1f}s  {r['bound_by']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
