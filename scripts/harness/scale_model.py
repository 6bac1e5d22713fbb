"""The recovery-time and goodput model at scale that scripts/simulate_scale.py prints (its
docstring says what each approach is and what the model counts) and scripts/calibrate_scale.py
checks against this machine: every figure an assumption, each phase a formula of them."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
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
    round_after_loss_s: float | None = None
    """torchrevive's round once a loss is seen, all included; None: ``rejoin_polls`` state reads
    plus ``rendezvous_s``. ``--control-plane`` sets it from bench_control_plane.py's results."""
    mtbf_s: float = 3600.0
    """Mean time between failures of the job: one node lost an hour."""
    checkpoint_interval_s: float = 1800.0
    """Storage snapshots, for every approach: one every 30 minutes."""
    storage_write_gbps: float = 100.0
    """Parallel filesystem aggregate write bandwidth."""
    staging_gbps: float = 20.0
    """A GPU's copy of its state into pinned host memory (device to host)."""
    torchsnapshot_staging_factor: float = 16.9
    """How much longer torchsnapshot's async_take keeps training waiting than a staging copy:
    measured here, 2.55 s against torchrevive's staged 0.151 s for 2 GB (bench_save.py)."""
    memory_interval_s: float = 60.0
    """torchrevive's memory tier: a snapshot in the nodes' RAM, replicated on a buddy, this often."""

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


def node_restore_bytes(a: Assumptions) -> tuple[float, float]:
    """What each surviving node restores for its ranks with torchrevive, and the seconds the
    replicated stripes' exchange takes (0 when every rank reads replicated state whole)."""
    nodes = a.nodes - 1
    sharded = a.size_bytes * (1 - a.replicated_fraction) / nodes
    replicated = a.size_bytes * a.replicated_fraction
    if a.stripe_replicated:  # read once per cluster, a stripe per node, then exchanged
        return sharded + replicated / nodes, replicated / (a.nic_gbps * 1e9)
    return sharded + replicated * a.gpus_per_node, 0.0  # every rank reads it whole


def fetched_while_workers_start(own: float, fetch_s: float, workers_start_s: float, a: Assumptions) -> float:
    """The restore after the workers started: the node's agent fetched its ``own`` bytes into
    local memory (``fetch_s`` for all of them) while they started; the ranks copy what arrived
    and wait for the rest."""
    fetched = min(fetch_s, workers_start_s)
    return fetch_s - fetched + own * (fetched / fetch_s if fetch_s else 0) / (a.memory_gbps * 1e9)


def torchrevive(a: Assumptions) -> dict[str, float]:
    # A killed agent's connections close at once and it is dropped from the round for every node.
    # A hung one is found when its last heartbeat, on average half an interval before it hung, is
    # keep_alive x attempts old, by a watch reading the state every keep_alive / 4 (half that on
    # average). Then the round takes a few polls of the state.
    heartbeat_lapse = a.keep_alive_s * a.keep_alive_attempts - a.keep_alive_s / 2
    detect = heartbeat_lapse + a.keep_alive_s / 8 if a.failure == "hang" else a.liveness_detect_s
    rendezvous = a.round_after_loss_s
    if rendezvous is None:
        rendezvous = a.rejoin_polls * a.keep_alive_s / 10 + a.rendezvous_s
    workers_start = torchrevive_worker_start_s(a)
    own, exchange = node_restore_bytes(a)
    # The agent prefetches the node's share from storage into the page cache while the workers start.
    read = read_s(own, a, a.torchrevive_efficiency, a.nodes - 1)
    restore = fetched_while_workers_start(own, read, workers_start, a) + exchange
    return {"detect": detect, "rendezvous": rendezvous, "workers_start": workers_start, "restore": restore,
            "first_step": a.first_step_s}


def torchrevive_memory(a: Assumptions) -> dict[str, float]:
    """torchrevive restoring the newest memory snapshot: each node's agent pulls the bytes its
    ranks read from the peers' RAM over the network (all of them, at worst: resharded to one node
    fewer, a node's new share lies mostly on others) while the workers start."""
    phases = torchrevive(a)
    own, exchange = node_restore_bytes(a)
    pull = own / (a.nic_gbps * 1e9)
    phases["restore"] = fetched_while_workers_start(own, pull, phases["workers_start"], a) + exchange
    return phases


APPROACHES = {"classic": classic, "parallel": parallel, "torchrevive": torchrevive,
              "torchrevive_memory": torchrevive_memory}


@dataclass(frozen=True)
class Tier:
    """One way an approach snapshots: how often, how long training waits for each snapshot, and
    how long after its step a snapshot is committed (restorable)."""

    interval_s: float
    blocking_s: float
    commit_s: float


def storage_write_s(a: Assumptions) -> float:
    """Every node writing its share of the state: bound by the client or the aggregate."""
    per_node_gbps = min(a.client_gbps, a.storage_write_gbps / a.nodes)
    return a.size_bytes / a.nodes / (per_node_gbps * 1e9)


def tiers(approach: str, a: Assumptions) -> list[Tier]:
    """How ``approach`` snapshots (see the module's docstring)."""
    write = storage_write_s(a)
    stage = a.size_bytes / a.gpus / (a.staging_gbps * 1e9)
    if approach == "classic":
        return [Tier(a.checkpoint_interval_s, write, write)]
    if approach == "parallel":
        stage *= a.torchsnapshot_staging_factor
    storage = Tier(a.checkpoint_interval_s, stage, stage + write)
    if approach != "torchrevive_memory":
        return [storage]
    node_share = a.size_bytes / a.nodes  # written to the node's tmpfs and sent to its buddy
    memory_commit = stage + node_share / (a.memory_gbps * 1e9) + node_share / (a.nic_gbps * 1e9)
    return [storage, Tier(a.memory_interval_s, stage, memory_commit)]


def goodput(recovery_s: float, snapshot_tiers: list[Tier], a: Assumptions) -> dict[str, float]:
    """The share of wall-clock time that trains: saving takes its blocking share all the time, and
    each failure (one per ``mtbf_s``, at a random moment) costs the recovery plus the work since the
    newest committed snapshot (half an interval plus its commit latency, on average)."""
    lost = min(t.interval_s / 2 + t.commit_s for t in snapshot_tiers)
    overhead = sum(t.blocking_s / t.interval_s for t in snapshot_tiers)
    trains = max(0.0, 1 - overhead) * max(0.0, 1 - (recovery_s + lost) / a.mtbf_s)
    return {"goodput": trains, "lost_work_s": lost, "save_overhead": overhead}


def simulate(a: Assumptions) -> dict:
    approaches = {}
    for name, model in APPROACHES.items():
        phases = model(a)
        total = sum(phases.values())
        approaches[name] = {"total_s": total, "phases": phases, "bound_by": max(phases, key=phases.get),
                            **goodput(total, tiers(name, a), a)}
    return {"assumptions": {**asdict(a), "nodes": a.nodes}, "approaches": approaches}


def round_after_loss(path: Path, nodes: int) -> dict[str, float]:
    """torchrevive's round after a detected loss at ``nodes`` nodes, from bench_control_plane.py's
    etcd3 results (re-rendezvous minus the last detection, per node count): a least-squares line,
    evaluated at ``nodes``."""
    results = json.loads(path.read_text())["results"].get("etcd3", {})
    points = sorted((int(n), r["rerendezvous_s"] - r["detect_s"]) for n, r in results.items()
                    if r.get("rerendezvous_s") is not None and r.get("detect_s") is not None)
    if len(points) < 2:
        raise ValueError(f"{path}: needs etcd3 re-rendezvous results at two node counts or more, has {len(points)}")
    line = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return {"per_node_s": line.slope, "intercept_s": line.intercept,
            "round_after_loss_s": line.intercept + line.slope * nodes, "points": points}
