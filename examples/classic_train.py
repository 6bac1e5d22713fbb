"""The classic way to checkpoint and resume, for the baseline of scripts/local_cluster.py: plain
torchrun, rank 0 `torch.save`s the whole state, and on every (re)start rank 0 `torch.load`s it
and broadcasts every tensor to the other ranks. Same model and steps as examples/train.py (DDP).

Rank 0 appends {"time", "event", "step", "world_size", "samples"} lines to --marks
(examples/mlp.py's `mark`): `first_step_done` for the first step after a (re)start, `step` for
every other, `saved`. Each rank trains --batch-size samples a step, so a smaller world trains
fewer samples a step (``samples``: all ranks' together).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from examples.mlp import build_model, mark, synthetic_dataset


def parse_args(description: str = __doc__) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--interval-steps", type=int, default=5)
    parser.add_argument("--marks", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    return parser.parse_args()


def train(args: argparse.Namespace, after_step: Callable[[int], None] = lambda step: None) -> None:
    """Resume from the checkpoint, if any, and train; ``after_step(step)`` runs on every rank after
    each step (before that step's save). Joins the default gloo group unless one exists."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(build_model(args.width, torch.device("cpu")))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    checkpoint = args.dir / "state.pt"
    step = torch.zeros((), dtype=torch.int64)
    if checkpoint.exists():  # rank 0 reads everything, then broadcasts every tensor
        state = torch.load(checkpoint, weights_only=True) if rank == 0 else None
        model.load_state_dict(state["model"] if rank == 0 else model.state_dict())
        for p in model.parameters():
            optimizer.state[p] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        if rank == 0:
            optimizer.load_state_dict(state["optim"])
            step.fill_(state["step"])
        for tensor in [*model.state_dict().values(), *(t for s in optimizer.state.values() for t in s.values()), step]:
            dist.broadcast(tensor, src=0)
    start = int(step)
    x_all, y_all, _ = synthetic_dataset(4096, 0).tensors
    for current in range(start, 1_000_000):
        rows = torch.arange(args.batch_size) + (current * dist.get_world_size() + rank) * args.batch_size
        x, y = x_all[rows % len(x_all)], y_all[rows % len(y_all)]
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        after_step(current + 1)
        if rank == 0:
            mark(args.marks, "first_step_done" if current == start else "step", current + 1,
                 world_size=dist.get_world_size(), samples=args.batch_size * dist.get_world_size())
        if (current + 1) % args.interval_steps == 0 and rank == 0:
            args.dir.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": current + 1},
                       checkpoint.with_suffix(".tmp"))
            os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
            mark(args.marks, "saved", current + 1, world_size=dist.get_world_size())


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    train(parse_args())
    sys.stdout.flush()
    os._exit(0)  # see examples/train.py: torch 2.13's gloo destructor can deadlock
