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

Beside the time to the first step, each approach's goodput under failures: the share of wall-clock
time that trains, with one failure every ``--mtbf-s`` (an hour) and storage snapshots every
``--checkpoint-interval-s`` for every approach. A failure costs the recovery plus the work since
the newest committed snapshot (half an interval, plus the snapshot's commit latency, on average);
saving costs the time training waits for each save, all the time:

  classic      saves synchronously (every rank writes its shard; training waits until written);
  parallel     torchsnapshot's async_take (training waits while it stages, then it writes);
  torchrevive  staged saves (a copy into reused pinned buffers), committed once durable;
  torchrevive_memory  the same, plus a memory snapshot every ``--memory-interval-s`` in the nodes'
               RAM with a replica on a buddy node; a recovery pulls its share from the peers.

Every figure the model uses is an assumption printed with the result (override with flags);
``--control-plane PATH`` takes torchrevive's round time after a detected loss from
bench_control_plane.py's etcd3 results (a line through them, by node count) instead of
``--rendezvous-s``; scripts/calibrate_scale.py checks the recovery model against this machine.
JSON: {"assumptions": {...}, "approaches": {NAME: {"total_s", "phases": {PHASE: s}, "bound_by",
"goodput", "lost_work_s", "save_overhead"}}}.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path

from harness.scale_model import PHASES, Assumptions, round_after_loss, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-tb", type=float, default=1.0)
    derived = {"size_bytes", "round_after_loss_s"}
    for f in fields(Assumptions):
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name not in derived:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    parser.add_argument("--control-plane", type=Path, default=None,
                        help="bench_control_plane.py's JSON: torchrevive's round after a loss from its etcd3 results")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    values = {f.name: getattr(args, f.name) for f in fields(Assumptions) if f.name not in derived}
    a = Assumptions(size_bytes=args.size_tb * 1e12, **values)
    control_plane = round_after_loss(args.control_plane, a.nodes) if args.control_plane else None
    if control_plane is not None:
        a = replace(a, round_after_loss_s=control_plane["round_after_loss_s"])
    result = simulate(a)
    if control_plane is not None:
        result["control_plane"] = {"path": str(args.control_plane), **control_plane}
    print(f"{a.gpus} GPUs ({a.nodes} nodes x {a.gpus_per_node}), {a.size_bytes / 1e12:g} TB state, "
          f"failure: {a.failure}; storage {a.storage_aggregate_gbps:g} GB/s aggregate, "
          f"{a.client_gbps:g} GB/s per node, NIC {a.nic_gbps:g} GB/s; one failure every {a.mtbf_s:g} s, "
          f"storage snapshots every {a.checkpoint_interval_s:g} s")
    print(f"{'approach':18s} " + " ".join(f"{p:>13s}" for p in PHASES)
          + f" {'total':>10s}  {'work lost':>9s} {'saving':>7s} {'goodput':>7s}  bound by")
    for name, r in result["approaches"].items():
        print(f"{name:18s} " + " ".join(f"{r['phases'][p]:12.1f}s" for p in PHASES)
              + f" {r['total_s']:9.1f}s  {r['lost_work_s']:8.1f}s {r['save_overhead']:7.2%} {r['goodput']:7.3f}"
              + f"  {r['bound_by']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
