"""Healing FSDP2 state from the ranks' memory at a re-formed round (agent.heal_sharded), on real
gloo ranks: a join re-lays every shard to the new mesh from the ranks that held it; a loss, where a
shard went with its node, leaves every rank to restore from a snapshot."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from agent.elastic_sampler import ElasticSampler
from agent.heal_sharded import heal_sharded, holds_dtensors
from agent.resilient import _leave_process_group
from tests.distributed import run_ranks


def _sharded(world_size: int, seed: int) -> dict:
    """A model whose rows do not divide evenly by 3 or 4 (13, 7), FSDP2 over every rank, AdamW, a
    sampler."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 13), nn.ReLU(), nn.Linear(13, 7))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.05),
            "data": ElasticSampler(96, global_batch_size=12, micro_batch_size=12 // world_size,
                                   rank=dist.get_rank(), world_size=world_size, seed=0)}


def _train(state: dict, steps: int) -> None:
    for _ in range(steps):
        state["optim"].zero_grad()
        state["model"](torch.randn(4, 5)).square().sum().backward()
        state["optim"].step()
        state["data"].advance()


def _full(state: dict) -> dict:
    """Every tensor of the model and optimizer, whole (collective), and the data position."""
    model = {k: v.full_tensor() for k, v in state["model"].state_dict().items()}
    optim = {(i, name): (v.full_tensor() if hasattr(v, "full_tensor") else v)
             for i, entry in state["optim"].state_dict()["state"].items() for name, v in entry.items()}
    return {"model": model, "optim": optim, "data": state["data"].state_dict()}


def _form(stores: list[TCPStore | None], ports: list[int], index: int, rank: int, world_size: int) -> None:
    """Join round ``index``'s process group (process 0 holds every round's store)."""
    store = stores[index] or TCPStore("127.0.0.1", ports[index], world_size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _rounds(process: int, processes: int, out: str) -> None:
    """Round A: processes 0-2 (a world of 3) train 2 steps. Round B: process 3 joins (4), every
    process at a new rank. Round C: processes 0 and 1 alone, as if 2 and 3 were lost. Then all
    four again, for run_ranks' closing barrier."""
    stores = [TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False) if process == 0 else None
              for n in (3, 4, 2, 4)]
    ports = [s.port if s else None for s in stores]
    dist.broadcast_object_list(ports, src=0)
    _leave_process_group("gloo")
    previous, held = None, None
    if process < 3:
        _form(stores, ports, 0, process, 3)
        previous = _sharded(3, seed=1)
        _train(previous, 2)
        reference = _full(previous)
        if process == 0:
            torch.save(reference, Path(out) / "reference.pt")
        held = 2
        _leave_process_group("gloo")
    _form(stores, ports, 1, (process + 1) % 4, 4)
    state = _sharded(4, seed=2)  # built anew for the new world, its values not the job's
    assert holds_dtensors(state)
    healed = heal_sharded(state, previous, held)
    assert healed is not None and healed.step == 2, healed
    assert (healed.sources != ()) == (process == 3) and (healed.bytes > 0 or process != 3), healed
    whole = _full(state)
    if dist.get_rank() == 0:
        torch.save(whole, Path(out) / "healed.pt")
    _train(state, 1)  # the optimizer goes on from the healed moments
    _leave_process_group("gloo")
    if process < 2:
        _form(stores, ports, 2, process, 2)
        assert heal_sharded(_sharded(2, seed=3), state, 3) is None  # shards 2 and 3 of 4 are gone
        _leave_process_group("gloo")
    _form(stores, ports, 3, process, 4)


def test_a_join_relays_every_shard_from_the_ranks_that_held_it_and_a_loss_leaves_it_to_a_snapshot(tmp_path):
    run_ranks(4, _rounds, str(tmp_path), timeout_s=180)
    reference, healed = torch.load(tmp_path / "reference.pt"), torch.load(tmp_path / "healed.pt")
    assert healed["data"] == reference["data"]
    for key, value in reference["model"].items():
        assert torch.equal(healed["model"][key], value), key
    assert set(healed["optim"]) == set(reference["optim"])
    for key, value in reference["optim"].items():
        assert torch.equal(healed["optim"][key], value), key
