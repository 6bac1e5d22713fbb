"""FSDP2 over tensor parallelism on a 2-D mesh (as torchtitan builds it: the FSDP dimension shards
what TP sharded already, a `_StridedShard` placement), with AdamW state: saved by the Checkpointer,
restored at the same layout, with the TP degree kept at fewer ranks, and into FSDP2 alone at
another world size; bit for bit against the full state gathered by DCP's state dict utilities
(gloo, real processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from agent.checkpoint import Checkpointer
from agent.torch_private import is_strided_shard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""The whole unsharded state, gathered to rank 0's CPU (the other ranks get an empty dict)."""


def build(seed: int, world_size: int, tp: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """30 hidden rows: uneven once TP halves them (15) and FSDP splits those again (8 and 7). The
    last layer is left whole by TP, so every TP rank of a data-parallel shard holds the same shard
    of it (torchsnapshot writes it from one of them only)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 30), nn.GELU(), nn.Linear(30, 16), nn.Linear(16, 12))
    if tp > 1:
        mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": get_model_state_dict(model, options=FULL),
            "optim": get_optimizer_state_dict(model, optim, options=FULL).get("state", {})}


def train_and_save(rank: int, world_size: int, root: str, tp: int) -> None:
    model, optim = build(0, world_size, tp)
    assert any(is_strided_shard(p) for param in model.parameters() for p in param.placements)
    for step in range(2):
        torch.manual_seed(100 + step)  # the same batch on every rank: TP ranks must see the same input
        model(torch.randn(4, 16)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    checkpointer = Checkpointer(root)
    checkpointer.save(2, {"model": model, "optim": optim})
    checkpointer.wait()
    reference = full_state(model, optim)
    if rank == 0:
        torch.save(reference, Path(root) / "reference.pt")


def restore_and_check(rank: int, world_size: int, root: str, tp: int) -> None:
    model, optim = build(1, world_size, tp)  # other weights, no optimizer state yet
    assert Checkpointer(root).restore({"model": model, "optim": optim}) == 2
    got = full_state(model, optim)  # a collective; the full state lands on rank 0 only
    if rank == 0:
        torch.testing.assert_close(got, torch.load(Path(root) / "reference.pt", weights_only=True), rtol=0, atol=0)
    model(torch.randn(2, 16)).sum().backward()  # and it trains on
    optim.step()


@pytest.mark.parametrize("world_size, tp", [(4, 2), (2, 2), (3, 1)],
                         ids=["same-layout", "fewer-ranks-tp-kept", "fsdp-only-at-3"])
def test_fsdp2_over_tp_saves_and_reshards(tmp_path, world_size, tp):
    root = str(tmp_path / "checkpoints")
    run_ranks(4, train_and_save, root, 2)
    run_ranks(world_size, restore_and_check, root, tp)
