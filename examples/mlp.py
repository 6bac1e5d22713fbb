"""The example jobs' model, data and step marks, shared by examples/train.py, the classic
baseline (examples/classic_train.py) and the peers' workers (scripts/peers/): plain torch, so that
it imports where torchrevive is not installed."""

from __future__ import annotations

import json
import os
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset


def mark(path: str | os.PathLike[str], event: str, step: int, **fields: object) -> None:
    """Append {"time", "event", "step", **fields} to ``path``: ``first_step_done`` for the first
    step of a (re)started job, ``step`` for every other step, ``saved`` for a checkpoint."""
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), "event": event, "step": step, **fields}) + "\n")


def build_model(width: int, device: torch.device, *, initialize: bool = True) -> nn.Module:
    """The MLP on ``device``; with ``initialize=False`` its parameters get memory but no initial
    values (for a model about to be restored: random init of a large model is seconds of CPU)."""

    def layers() -> nn.Module:
        return nn.Sequential(
            nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
            # 8 outputs, not 1: torchsnapshot cannot save an empty FSDP2 shard, which a 1-row layer
            # has on every rank but the first.
            nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8),
        )

    if initialize:
        return layers().to(device)
    with torch.device("meta"):
        model = layers()
    return model.to_empty(device=device)


def synthetic_dataset(samples: int, seed: int) -> TensorDataset:
    """(input, target, sample id): a smooth target to regress, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 64, generator=generator)
    return TensorDataset(x, torch.sin(x[:, :8].cumsum(dim=1)), torch.arange(samples))
