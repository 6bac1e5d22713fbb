"""DCP checkpoints (written by dcp.save / dcp.async_save) restored through FastStorageReader and
agent.restore, compared bit for bit with dcp.load's own FileSystemReader: every dtype, views,
several writer threads, objects, and FSDP2 model + optimizer state resharded N -> M on gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import agent
from agent.restore.dcp_reader import FastStorageReader

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn]
SHAPES = {"0-d": (), "empty": (0,), "small": (7,), "odd-2d": (3, 5), "large": (301, 257)}


def tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(-100, 100, shape).to(dtype)
    return torch.randn(shape).to(dtype)


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(-1).view(torch.uint8).numpy()) if t.numel() else b""


def zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@pytest.mark.parametrize("thread_count", [1, 3])
def test_every_dtype_and_view_matches_dcp_load(tmp_path, thread_count):
    torch.manual_seed(0)
    state = {f"{str(dt).removeprefix('torch.')}-{name}": tensor(dt, shape) for dt in DTYPES for name, shape in SHAPES.items()}
    state["view"] = torch.randn(64, 64)[8:40:2, 3:50]  # a strided view: torch.save keeps its storage
    state["step"] = 7
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=thread_count))
    theirs, ours = zeros_like(state), zeros_like(state)
    theirs["step"] = ours["step"] = 0
    dcp.load(theirs, checkpoint_id=tmp_path)
    reader = FastStorageReader(tmp_path)
    dcp.load(ours, storage_reader=reader)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert bits(ours[key]) == bits(theirs[key]) == bits(value), key
    assert ours["step"] == theirs["step"] == 7
    assert reader.bytes_read == sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def model_and_optim(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 16)).sum().backward()
    optim.step()
    return model, optim


def test_agent_restore_reads_a_dcp_checkpoint(tmp_path):
    model, _ = model_and_optim(0)
    future = dcp.async_save({"model": model}, checkpoint_id=tmp_path)
    future.result()
    target, _ = model_and_optim(1)
    stats = agent.restore(tmp_path, {"model": target})
    assert stats.bytes_read > 0 and stats.num_tensors == 4
    for got, want in zip(target.state_dict().values(), model.state_dict().values()):
        assert torch.equal(got, want)


def fsdp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 7), nn.GELU(), nn.Linear(7, 10))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 10)).sum().backward()
    optim.step()
    return model, optim


def write_fsdp(rank: int, world_size: int, path: str) -> None:
    model, optim = fsdp(0)
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def local(state: dict) -> dict:
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in local(value).items()})
        elif isinstance(value, torch.Tensor):
            flat[key] = (value.to_local() if isinstance(value, DTensor) else value).clone()
    return flat


def read_fsdp(rank: int, world_size: int, path: str) -> None:
    states = []
    for reader in (dcp.FileSystemReader(path), FastStorageReader(path)):
        model, optim = fsdp(1 + rank)
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=reader)
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        states.append(local({"model": model_sd, "optim": optim_sd}))
    theirs, ours = states
    assert theirs.keys() == ours.keys() and any("exp_avg" in k for k in ours)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), (rank, key)
    dist.barrier()


@pytest.mark.parametrize(("written", "read"), [(2, 3), (3, 1)])
def test_fsdp2_model_and_optimizer_reshard_like_dcp_load(tmp_path, written, read):
    run_ranks(written, write_fsdp, str(tmp_path))
    run_ranks(read, read_fsdp, str(tmp_path))
