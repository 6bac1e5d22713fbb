"""examples/classic_train.py's job as one torchft 0.2.0 replica group (scripts/harness/torchft_cluster.py
starts one per node, each its own torchrun job): the same model, Adam and MSE loss on the same
data, with torchft's fault-tolerant data parallelism: a torchft ``Manager`` per rank, whose
quorum (from the Lighthouse) names the replica groups of each step, ``Manager.allreduce`` to
average the gradients over them, and ``torchft.optim.OptimizerWrapper`` (``zero_grad`` starts the
quorum, ``step`` steps Adam only when ``Manager.should_commit()``), as train_ddp.py (torchft
0.2.0's sdist) does. When a peer group dies mid-step, the survivors' gloo all-reduce fails
(connection reset, or the process group's timeout), no survivor commits the step, and the next
quorum goes on without the dead group once the Lighthouse stops hearing its heartbeats; a group
that (re)starts heals from a live peer: the Manager fetches the model and optimizer state (the
``state_dict`` callback) and its step, and the group trains on.

Manual all-reduce, not train_ddp.py's ``torchft.ddp.DistributedDataParallel``: on CPU/gloo, with
torch 2.13, that path kills every survivor when a peer dies mid-step. ``_ManagedWork.wait()``
(torchft/manager.py) catches the all-reduce's error ("Connection reset by peer") and returns
before it has set up the work's future chain, and ``DistributedDataParallel._comm_hook``
(torchft/ddp.py) then fails ``assert fut._fut`` (AssertionError) inside ``backward()``; torchrun
restarts the survivors, and with no live peer left they all start over from step 0 (seen in a
3-group kill test). So, as torchft's own manager tests and ``PureDistributedDataParallel``
(ddp.py) do, the gradients are all-reduced after ``backward()`` with ``Manager.allreduce`` (one
flat bucket, as DDP's) and ``wait()``ed; an error is recorded for ``should_commit()``, not raised.

Configuration (flags; every value, with where torchft recommends it):
  Manager(min_replica_size=1)                  train_ddp.py; docs assumptions_and_recommendations.rst
  Manager(timeout=30 s)            --timeout-s train_ddp.py ``timeout=timedelta(seconds=30)``
  Manager(quorum_timeout=60 s)     --quorum-timeout-s  Manager's default; assumptions_and_recommendations.rst:
                                   keep it high, above a step (and above ``timeout``)
  Manager(connect_timeout=60 s)    --connect-timeout-s  Manager's default
  Manager(heartbeat_interval=100 ms) --heartbeat-interval-ms  Manager's default (the Lighthouse
                                   drops a group after its --heartbeat_timeout_ms: see scripts/harness/torchft_cluster.py)
  Manager(use_async_quorum=True, init_sync=True, quorum_retries=0, max_retries=None)  defaults
  ProcessGroupGloo(timeout=5 s)    --pg-timeout-s  train_ddp.py ``ProcessGroupGloo(timeout=timedelta(seconds=5))``
  PGTransport(timeout=10 s)        --transport-timeout-s  train_ddp.py: the healing state goes over the
                                   replica groups' process group
  replica_id "torchft_train_<group>"  train_ddp.py's ``train_ddp_<REPLICA_GROUP_ID>`` (the Manager appends a uuid)
The TORCHFT_TIMEOUT_SEC, TORCHFT_QUORUM_TIMEOUT_SEC and TORCHFT_CONNECT_TIMEOUT_SEC environment
variables, when set, override the Manager's three timeouts (torchft/manager.py). The Lighthouse
address comes from TORCHFT_LIGHTHOUSE.

Data: each group trains --batch-size samples a step, split over its ranks, the rows the classic
baseline gives the same place in the full world: step s, group g, rank r of R ranks per group of G
groups (--num-replica-groups, NUM_REPLICA_GROUPS as train_ddp.py) take rows
((s * G + g) * R + r) * b .. + b (mod 4096), b = --batch-size / R. With R > 1, the gradients are
averaged over the group's ranks (a plain gloo process group of the group's own torchrun job),
then across the groups by torchft (rank r with rank r of every group).

Marks (rank 0 of each group, examples/mlp.py's ``mark``, to --marks): per step, {"time", "event",
"step", "world_size", "samples", "replica_group"}: event ``first_step_done`` for the group's first
committed step since its process started, ``step`` for every other committed step, with ``step``
the Manager's step after the commit, ``world_size`` the replica groups that trained the step
(``Manager.num_participants()``: the quorum's groups at its highest step, not a group that heals
in it, which contributes zeros) x ranks per group and ``samples`` those groups x --batch-size; a
step that ``should_commit()`` rejects trains nothing and is marked ``step_discarded`` with samples
0 and the unchanged step. Rank 0 of group 0 also ``torch.save``s {"model", "optim", "step",
"torchft"} (the Manager's state_dict, as its docstring asks of periodic checkpoints) to
--dir/state.pt every --interval-steps committed steps (tmp + os.replace) and marks ``saved``. The
checkpoint is only written (the same cost as the other approaches'): a restarted group heals from
a live peer, as train_ddp.py, which loads no checkpoint either.
Runs from the peers' environment: plain torch, torchft and examples/mlp.py only.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport
from torchft.optim import OptimizerWrapper

from examples.mlp import build_model, mark, synthetic_dataset


class CommitOptimizer(OptimizerWrapper):
    """torchft's OptimizerWrapper, which also keeps whether its last ``step`` was committed."""

    committed = False

    def step(self, closure: object = None) -> None:
        assert closure is None, "optimizers that use closures are not supported"
        self.committed = self.manager.should_commit()
        if self.committed:
            self.optim.step()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per replica group per step")
    parser.add_argument("--steps", type=int, default=sys.maxsize, help="stop at this Manager step")
    parser.add_argument("--interval-steps", type=int, default=5)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--marks", type=Path, required=True, help="this group's step marks (JSON lines)")
    parser.add_argument("--replica-group", type=int, default=int(os.environ.get("REPLICA_GROUP_ID", "0")))
    parser.add_argument("--num-replica-groups", type=int, default=int(os.environ.get("NUM_REPLICA_GROUPS", "1")),
                        help="groups of the full job (for the data layout only)")
    parser.add_argument("--timeout-s", type=float, default=30)
    parser.add_argument("--quorum-timeout-s", type=float, default=60)
    parser.add_argument("--connect-timeout-s", type=float, default=60)
    parser.add_argument("--heartbeat-interval-ms", type=float, default=100)
    parser.add_argument("--pg-timeout-s", type=float, default=5)
    parser.add_argument("--transport-timeout-s", type=float, default=10)
    parser.add_argument("--hostname", default=None, help="the address peers reach this group's Manager at "
                        "(default: the host's name, as the Manager's)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO)  # torchft's quorum, heal and commit lines, as train_ddp.py
    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # within this group's torchrun job
    if ranks > 1:  # the group's own ranks average their gradients over it (then torchft across the groups)
        dist.init_process_group("gloo")
    if args.batch_size % ranks:
        raise SystemExit(f"--batch-size {args.batch_size} does not divide over {ranks} ranks")
    per_rank = args.batch_size // ranks
    torch.manual_seed(0)
    model = build_model(args.width, torch.device("cpu"))  # no DDP wrapper: see the module docstring
    params = list(model.parameters())

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s))
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"torchft_train_{args.replica_group}", timeout=timedelta(seconds=args.timeout_s),
        quorum_timeout=timedelta(seconds=args.quorum_timeout_s),
        connect_timeout=timedelta(seconds=args.connect_timeout_s),
        heartbeat_interval=timedelta(milliseconds=args.heartbeat_interval_ms),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=args.transport_timeout_s),
                                         device=torch.device("cpu")),
        **({"hostname": args.hostname} if args.hostname else {}))
    optimizer = CommitOptimizer(manager, torch.optim.Adam(model.parameters(), lr=1e-3))
    x_all, y_all, _ = synthetic_dataset(4096, 0).tensors
    first = True
    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # starts the quorum (asynchronously)
        current = manager.current_step()  # a healing group's step is its stale one: it trains zeros
        rows = torch.arange(per_rank) + ((current * args.num_replica_groups + args.replica_group) * ranks + rank) * per_rank
        x, y = x_all[rows % len(x_all)], y_all[rows % len(y_all)]
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in params])  # one bucket, as DDP's
        if ranks > 1:
            dist.all_reduce(grads)
            grads /= ranks
        # Waits for the quorum, then averages over the step's participating groups (zeros from a
        # healing one); a failure (a peer died) is recorded for should_commit(), not raised.
        manager.allreduce(grads).wait()
        offset = 0
        for p in params:
            p.grad.copy_(grads[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()  # should_commit(), then Adam when committed
        step, groups = manager.current_step(), manager.num_participants()
        if not optimizer.committed:
            if rank == 0:
                mark(args.marks, "step_discarded", step, world_size=groups * ranks, samples=0,
                     replica_group=args.replica_group)
            continue
        if rank == 0:
            mark(args.marks, "first_step_done" if first else "step", step, world_size=groups * ranks,
                 samples=groups * args.batch_size, replica_group=args.replica_group)
        first = False
        if step % args.interval_steps == 0 and rank == 0 and args.replica_group == 0:
            args.dir.mkdir(parents=True, exist_ok=True)
            checkpoint = args.dir / "state.pt"
            torch.save({**state_dict(), "step": step, "torchft": manager.state_dict()}, checkpoint.with_suffix(".tmp"))
            os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
            mark(args.marks, "saved", step, world_size=groups * ranks, replica_group=args.replica_group)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see examples/worker_process.py: torch 2.13's gloo destructor can deadlock
