"""On a CUDA machine: an FSDP2 model and its Adam state on the GPU, in a NCCL process group, saved by
`Checkpointer` (staged from the GPU) and restored into a fresh FSDP2 model on the GPU, bit for bit;
then the same snapshot restored into a plain (unsharded) model on the CPU.

    python scripts/gpu_fsdp_check.py   # one process, one GPU; exits non-zero on any mismatch

What it shows: the CUDA side of the save (staging DTensor shards from device memory) and of the
restore (DTensor destinations in device memory) under NCCL, which the CPU test suite cannot run.
With one GPU the world is one rank, so resharding across ranks is covered by the CPU tests only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import agent
from agent.checkpoint import Checkpointer


def build(seed: int, device: str, shard: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(device)
    if shard:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):  # Adam state exists only after a step
        optim.zero_grad()
        model(torch.randn(32, 1024, device=device)).square().mean().backward()
        optim.step()
    return model, optim


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def flat_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
    for index, state in enumerate(optim.state.values()):
        for key, value in state.items():
            out[f"optim.{index}.{key}"] = local(value)
    return out


def main() -> None:
    assert torch.cuda.is_available(), "no CUDA device"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="torchrevive-gpu-fsdp-") as tmp:
        saved_model, saved_optim = build(0, "cuda", shard=True)
        ckpt = Checkpointer(Path(tmp), staging=True)
        ckpt.save(7, {"model": saved_model, "optim": saved_optim})
        ckpt.wait()
        want = flat_state(saved_model, saved_optim)

        model, optim = build(1, "cuda", shard=True)
        assert any(not torch.equal(a, b) for a, b in zip(flat_state(model, optim).values(), want.values()))
        step = Checkpointer(Path(tmp), staging=True).restore({"model": model, "optim": optim})
        torch.cuda.synchronize()
        got = flat_state(model, optim)
        assert step == 7, step
        assert got.keys() == want.keys(), (got.keys() ^ want.keys())
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        assert not bad, f"differs after the FSDP2 restore on CUDA: {bad}"
        print(f"FSDP2 on CUDA/NCCL: saved and restored {len(want)} tensors bit for bit")

        plain, _ = build(2, "cpu", shard=False)
        agent.restore(Path(tmp) / "step_7", {"model": plain})
        bad = [k for k, v in plain.state_dict().items() if not torch.equal(v, want[f"model.{k}"])]
        assert not bad, f"differs after the restore into a plain CPU model: {bad}"
        print("the same snapshot restored into a plain CPU model bit for bit")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
