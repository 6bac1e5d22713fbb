"""How far a tiny numerical difference carries in the goodput benchmark's training: the MLP of
examples/mlp.py (Adam, the global batch, initial weights and data order of examples/train.py)
trained twice in this process, side by side, the second with one step's gradients scaled by ``1 + rel * N(0, 1)`` elementwise (what a
different float summation order does, at about 1e-7). Prints each later step's relative loss
difference; the JSON has them all and their maximum.

bench_goodput.py flags an approach whose loss leaves the fault-free run's by more than its
``LOSS_RTOL``; this tells whether a difference as small as summation order can grow that large on
its own.

    .venv/bin/python scripts/loss_sensitivity.py --width 4618 --perturb-at 250 --steps 345 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from agent import ElasticSampler, batches_across_epochs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from mlp import build_model, synthetic_dataset  # noqa: E402

GLOBAL_BATCH = 48
"""examples/train.py's global batch."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4618, help="the MLP's width (4618: bench_goodput's 512 MB)")
    parser.add_argument("--steps", type=int, default=345)
    parser.add_argument("--perturb-at", type=int, default=250, help="the step whose gradients differ")
    parser.add_argument("--rel", type=float, default=1e-7, help="the relative size of the difference")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = build_model(args.width, torch.device("cpu"))
        return model, torch.optim.Adam(model.parameters(), lr=args.lr)

    runs = [trained(), trained()]
    data = synthetic_dataset(args.samples, 0)
    # examples/train.py's data order: its sampler at world size 1, one micro-batch a step.
    sampler = ElasticSampler(len(data), global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH, seed=0,
                             rank=0, world_size=1)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler)
    batches = batches_across_epochs(loader)
    differences: list[tuple[int, float]] = []
    for step in range(1, args.steps + 1):
        x, y, _ = next(batches)
        losses = []
        for index, (model, optimizer) in enumerate(runs):
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if index == 1 and step == args.perturb_at:
                with torch.no_grad():
                    for p in model.parameters():
                        p.grad.mul_(1 + args.rel * torch.randn_like(p.grad))
            optimizer.step()
            losses.append(loss.item())
        sampler.advance()
        if step > args.perturb_at:
            differences.append((step, abs(losses[0] - losses[1]) / abs(losses[0])))
            print(f"step {step} loss {losses[0]:.6f} relative difference {differences[-1][1]:.1e}", flush=True)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "args": vars(args) | {
              "json": str(args.json) if args.json else None}, "torch": torch.__version__,
              "max_relative_difference": max((d for _, d in differences), default=0.0), "differences": differences}
    print(f"max relative difference after step {args.perturb_at}: {report['max_relative_difference']:.1e}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
