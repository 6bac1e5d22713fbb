"""FSDP2 / DTensor state written by torchsnapshot at N ranks, restored by torchrevive at M ranks
(gloo, real processes): values equal the written state, and each rank reads only its shard."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchsnapshot
from distributed import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import agent
from agent import RestoreError
from agent.checkpoint import Checkpointer
from agent.prefetch import files_read
from agent.restore.manifest import load_metadata, manifest_for_rank, stored_tensor


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Uneven on purpose: 7 and 10 rows split unevenly over 2, 3 and 4 ranks (torchsnapshot itself
    cannot write an empty shard, so every rank keeps at least one row)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 7), nn.GELU(), nn.Linear(7, 10))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def extra_state(world_size: int) -> torchsnapshot.StateDict:
    """DTensors with explicit placements: 2-D mesh (Shard(0), Shard(1)) at 4 ranks, else 1-D."""
    torch.manual_seed(123)
    full = torch.randn(9, 6)
    if world_size == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        placed = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    else:
        placed = distribute_tensor(full, init_device_mesh("cpu", (world_size,)), [Shard(1)])
    replicated = distribute_tensor(full[:4].clone(), init_device_mesh("cpu", (world_size,)), [Replicate()])
    return torchsnapshot.StateDict(grid=placed, replicated=replicated)


def full_state(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = full_state(value)
        elif isinstance(value, DTensor):
            out[key] = value.full_tensor()
        else:
            out[key] = value
    return out


def write(rank: int, world_size: int, path: str) -> None:
    model, optim = build(seed=0)
    for step in range(2):
        torch.manual_seed(100 + step + rank)
        model(torch.randn(4, 10)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    extra = extra_state(world_size)
    torchsnapshot.Snapshot.take(path, {"model": model, "optim": optim, "extra": extra})
    reference = {"model": full_state(model.state_dict()), "optim": full_state(optim.state_dict()["state"]),
                 "extra": full_state(dict(extra))}
    if rank == 0:
        torch.save(reference, Path(path).parent / "reference.pt")


def local_bytes(state: dict) -> int:
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += local_bytes(value)
        elif isinstance(value, DTensor):
            local = value.to_local()
            total += local.numel() * local.element_size()
        elif isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def restore_and_check(rank: int, world_size: int, path: str) -> None:
    model, optim = build(seed=1)  # other weights, and no optimizer state yet
    extra = extra_state(world_size)
    for value in extra.values():
        value.to_local().zero_()
    stats = agent.restore(path, {"model": model, "optim": optim, "extra": extra})
    reference = torch.load(Path(path).parent / "reference.pt", weights_only=True)
    got = {"model": full_state(model.state_dict()), "optim": full_state(optim.state_dict()["state"]),
           "extra": full_state(dict(extra))}
    torch.testing.assert_close(got, reference, rtol=0, atol=0)
    assert all(isinstance(v, DTensor) for s in optim.state_dict()["state"].values() for k, v in s.items() if k != "step")
    expected = local_bytes(model.state_dict()) + local_bytes(optim.state_dict()["state"]) + local_bytes(dict(extra))
    assert expected <= stats.bytes_read <= math.ceil(1.05 * expected), (rank, stats.bytes_read, expected)
    # The restored job trains on: one more step runs on every rank.
    model(torch.randn(2, 10)).sum().backward()
    optim.step()


@pytest.mark.parametrize("written, restored", [(4, 3), (3, 4), (2, 1), (1, 2)])
def test_fsdp2_and_dtensor_state_reshards(tmp_path, written, restored):
    path = str(tmp_path / "snapshot")
    run_ranks(written, write, path)
    run_ranks(restored, restore_and_check, path)


def write_fsdp2(rank: int, world_size: int, path: str) -> None:
    model, optim = build(seed=0)
    model(torch.randn(4, 10)).square().mean().backward()
    optim.step()
    torchsnapshot.Snapshot.take(path, {"model": model, "optim": optim})
    reference = {"model": full_state(model.state_dict()), "optim": full_state(optim.state_dict()["state"])}
    if rank == 0:  # gathered on every rank (a collective), kept by one
        torch.save(reference, Path(path).parent / "reference.pt")


def files_it_reads(rank: int, world_size: int, path: str) -> tuple[Path, list[Path]]:
    """As a node of the memory tier holds it: a copy of the snapshot with only the files its ranks
    read (what ``agent.prefetch.files_read`` names, pulled from peers); the copy and what it lacks."""
    own = Path(path).parent / f"node{rank}"
    shutil.copytree(path, own)
    read = files_read(own, [rank], world_size)
    absent = [f for f in own.rglob("*") if f.is_file() and not f.name.startswith(".")
              and str(f.relative_to(own)) not in read]
    for file in absent:
        file.unlink()
    return own, absent


def restore_from_the_files_it_reads(rank: int, world_size: int, path: str) -> None:
    own, absent = files_it_reads(rank, world_size, path)
    assert any(f.parent.name == "batched" for f in absent), "no other rank's shards left out"
    model, optim = build(seed=1)
    agent.restore(own, {"model": model, "optim": optim})
    reference = torch.load(Path(path).parent / "reference.pt", weights_only=True)
    got = {"model": full_state(model.state_dict()), "optim": full_state(optim.state_dict()["state"])}
    torch.testing.assert_close(got, reference, rtol=0, atol=0)


def test_a_rank_restores_with_only_the_files_it_reads(tmp_path):
    path = str(tmp_path / "snapshot")
    run_ranks(4, write_fsdp2, path, timeout_s=120)
    run_ranks(2, restore_from_the_files_it_reads, path, timeout_s=120)


def restore_and_check_from_the_files_it_reads(rank: int, world_size: int, path: str) -> None:
    restore_and_check(rank, world_size, str(files_it_reads(rank, world_size, path)[0]))


def test_a_layout_other_than_rows_is_read_whole(tmp_path):
    """A 2-D (Shard(0), Shard(1)) tensor restored as Shard(1): a node's share of it is every chunk,
    not the rows an even split of dimension 0 would give it."""
    path = str(tmp_path / "snapshot")
    run_ranks(4, write, path, timeout_s=120)
    run_ranks(3, restore_and_check_from_the_files_it_reads, path, timeout_s=120)


def replicated_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(600, 700), nn.Linear(700, 8))  # 1.7 MB and 22 KB of weights


def write_replicated(rank: int, world_size: int, path: str) -> None:
    torchsnapshot.Snapshot.take(path, {"model": replicated_model(0)}, replicated=["**"])


def restore_striped(rank: int, world_size: int, path: str) -> None:
    model = replicated_model(1)
    stats = agent.restore(path, {"model": model}, replicated="stripe")
    for got, want in zip(model.state_dict().values(), replicated_model(0).state_dict().values()):
        assert torch.equal(got, want)
    big = 700 * 600 * 4
    small = sum(t.numel() * 4 for name, t in model.state_dict().items() if name != "0.weight")
    my_rows = 700 * (rank + 1) // world_size - 700 * rank // world_size
    assert stats.bytes_read == my_rows * 600 * 4 + small, (rank, stats.bytes_read)
    assert stats.bytes_exchanged == big
    totals = torch.tensor([stats.bytes_read])
    dist.all_reduce(totals)
    assert totals.item() == big + world_size * small  # the big tensor is read once per cluster


def test_replicated_state_is_read_once_per_cluster_in_stripes(tmp_path):
    path = str(tmp_path / "snapshot")
    run_ranks(2, write_replicated, path)
    run_ranks(3, restore_striped, path)


def sharded_tensor_state(world_size: int, values: torch.Tensor) -> torchsnapshot.StateDict:
    """A ShardedTensor (rows chunked over the ranks) holding this rank's rows of ``values``."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)])
    st = sharded_tensor.empty(spec, *values.shape)
    for shard in st.local_shards():
        start, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        shard.tensor.copy_(values[start : start + rows])
    return torchsnapshot.StateDict(st=st)


SHARDED_VALUES = torch.arange(60, dtype=torch.float32).reshape(10, 6)


def write_sharded_tensor(rank: int, world_size: int, path: str) -> None:
    torchsnapshot.Snapshot.take(path, {"s": sharded_tensor_state(world_size, SHARDED_VALUES)})


def restore_sharded_tensor(rank: int, world_size: int, path: str) -> None:
    state = sharded_tensor_state(world_size, torch.zeros_like(SHARDED_VALUES))
    stats = agent.restore(path, {"s": state})
    [shard] = state["st"].local_shards()
    start, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
    assert torch.equal(shard.tensor, SHARDED_VALUES[start : start + rows])
    assert stats.bytes_read == shard.tensor.numel() * 4


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sharded_tensor_reshards(tmp_path):
    path = str(tmp_path / "snapshot")
    run_ranks(2, write_sharded_tensor, path)
    run_ranks(3, restore_sharded_tensor, path)


STRIPED_SHAPE = (6000, 1500)
"""36 MB of float32: each of 3 ranks' stripes (12 MB) holds checksum blocks (4 MiB) no other rank reads."""


def striped_model(seed: int) -> DDP:
    """DDP: torchsnapshot stores its state as replicated, so that a striped restore stripes it."""
    torch.manual_seed(seed)
    return DDP(nn.Linear(STRIPED_SHAPE[1], STRIPED_SHAPE[0], bias=False))


def corrupt_row(snapshot: Path, logical_path: str, row: int) -> None:
    """Flip a byte of ``row`` of a stored matrix, in whichever chunk holds it."""
    stored = stored_tensor(manifest_for_rank(load_metadata(snapshot), 0)[logical_path])
    chunk = next(c for c in stored.chunks if c.offsets[0] <= row < c.offsets[0] + c.sizes[0])
    offset = chunk.byte_offset + (row - chunk.offsets[0]) * math.prod(chunk.sizes[1:]) * chunk.dtype.itemsize
    with open(snapshot / chunk.location, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def fall_back_together(rank: int, world_size: int, root: str) -> None:
    ckpt = Checkpointer(root, staging=False, verify="full", restore_options={"replicated": "stripe"})
    for step in (1, 2):
        ckpt.save(step, {"model": striped_model(step)})
    if rank == 0:  # the middle of rank 1's stripe: only rank 1's checks see it
        corrupt_row(Path(root) / "step_2", "model/module.weight", STRIPED_SHAPE[0] // 2)
    dist.barrier()
    target = striped_model(0)
    with pytest.warns(UserWarning, match=r"falling back from .*step_2: .*(rank 1 failed to restore its share|do not "
                                         r"match their checksum)"):
        assert ckpt.restore({"model": target}) == 1
    assert torch.equal(target.module.weight, striped_model(1).module.weight)


def test_a_stripe_failing_on_one_rank_falls_back_on_every_rank(tmp_path):
    """One rank's stripe fails its checksum: every rank leaves the striped restore together and
    falls back to the previous snapshot, none waits in a collective the others never join."""
    run_ranks(3, fall_back_together, str(tmp_path / "ckpt"), timeout_s=180)


class Broken:
    """A stateful that fails on one rank (a bug of the caller's, not a damaged snapshot)."""

    def state_dict(self) -> dict:
        raise ValueError("broken on this rank")

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("never loaded")


def fail_on_one_rank(rank: int, world_size: int, path: str) -> None:
    app_state = {"model": replicated_model(1)}
    if rank == 1:
        app_state["broken"] = Broken()
    expected = "broken on this rank" if rank == 1 else "rank 1 failed to restore its share .*broken on this rank"
    with pytest.raises(RestoreError, match=expected):
        agent.restore(path, app_state, replicated="stripe")


def test_any_failure_on_one_rank_of_a_striped_restore_is_a_restore_error_on_every_rank(tmp_path):
    """So that callers that fall back on RestoreError (the Checkpointer) do so on every rank."""
    path = str(tmp_path / "snapshot")
    run_ranks(2, write_replicated, path)
    run_ranks(3, fail_on_one_rank, path, timeout_s=180)
