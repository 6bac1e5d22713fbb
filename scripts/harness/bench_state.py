"""The state the save and restore benchmarks measure: a stack of square Linear layers and Adam,
of a chosen size; its bytes, DCP's view of it, and the machine it is measured on."""

from __future__ import annotations

import torch
from torch import nn

from harness.machine import describe

WIDTH = 4096


def build_state(size_bytes: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stack of square Linear layers and Adam with its moments: 3 floats per weight. The moments
    are set directly (no gradients), so that building never needs more memory than the state."""
    layers = max(1, round(size_bytes / (3 * 4 * (WIDTH * WIDTH + WIDTH))))
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    with torch.no_grad():
        for p in model.parameters():
            optim.state[p] = {"step": torch.tensor(float(seed + 1)), "exp_avg": p * 0.5 + seed, "exp_avg_sq": p.square()}
    return model, optim


def state_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    tensors = list(model.state_dict().values()) + [t for s in optim.state.values() for t in s.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def dcp_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": {f"{i}.{k}": v for i, s in optim.state_dict()["state"].items() for k, v in s.items()}}


def machine() -> dict:
    """The machine, and the reader threads torchrevive and raw_read both use on it."""
    from agent.restore.reader import default_io_threads

    return {**describe(), "io_threads": default_io_threads()}
