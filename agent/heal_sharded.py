"""Healing sharded state in-process, from the ranks' own memory: when the ranks that hold the
newest step held every shard of it in the last round (a join: nobody was lost), each rank of the
new round receives the rows of its new shard from the ranks that held them, point to point, and
nothing is read from storage. What FSDP2 shards this way: DTensors sharded on dim 0 over a
one-dimensional mesh (``fully_shard``'s layout, rows split as ``torch.chunk`` splits them), model
and optimizer state alike; the rest of the state (counters, the data position) comes whole from a
holder, as :func:`agent.heal.heal` sends replicated state.

When a shard of the newest step is gone with its node (a loss), or the state is laid out
otherwise (tensor parallel's two-dimensional mesh), every rank learns it from one all-gather and
:func:`heal_sharded` returns None: the round restores from a snapshot, as without it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from agent.checkpoint.stage import read_state_dicts
from agent.errors import RestoreError
from agent.heal import Healed, ShardedEntry, device_of_backend, leaves, receive_state, run_all, send_state

_FIRST_ROWS_TAG = 1 << 20
"""Tags of the rows' messages start here, clear of the replicated parts' (agent.heal)."""


class _Member(NamedTuple):
    """What one rank told the others: the step it holds (-1: none it can give), its coordinate in
    the last round's mesh and that mesh's size, its coordinate in the new mesh, and whether its
    new state is laid out as this module heals (1) or not (0)."""

    held: int
    old_coordinate: int
    old_size: int
    new_coordinate: int
    able: int


def holds_dtensors(app_state: Mapping[str, Any]) -> bool:
    """Whether a module of ``app_state`` is sharded by FSDP2 (even while its parameters are
    gathered) or has DTensor parameters (tensor parallel)."""
    return any(isinstance(m, FSDPModule) or any(isinstance(p, DTensor) for p in m.parameters(recurse=False))
               for obj in app_state.values() if isinstance(obj, nn.Module) for m in obj.modules())


def heal_sharded(app_state: Mapping[str, Any], previous: Mapping[str, Any] | None,
                 held_step: int | None) -> Healed | None:
    """Give every rank of the default process group its shard of the newest step the ranks hold,
    re-laid for ``app_state``'s mesh from the shards of the last round (``previous``: this rank's
    objects of that round, holding ``held_step``; None in a new process). None, on every rank,
    when the holders of the newest step lack a shard of it or a state is laid out otherwise;
    collective: every rank calls it."""
    started = time.perf_counter()
    device = device_of_backend()
    mesh = _row_sharded_mesh(read_state_dicts(app_state))
    old = read_state_dicts(previous) if previous is not None and held_step is not None else None
    old_mesh = _row_sharded_mesh(old) if old is not None else None
    me = _Member(held=held_step if old_mesh is not None and held_step is not None else -1,
                 old_coordinate=_coordinate(old_mesh), old_size=old_mesh.size() if old_mesh is not None else 0,
                 new_coordinate=_coordinate(mesh), able=int(mesh is not None and mesh.size() == dist.get_world_size()))
    members = _all_gather(me, device)
    newest = max(m.held for m in members)
    if newest < 0 or not all(m.able for m in members):
        return None
    world = len(members)
    if sorted(m.new_coordinate for m in members) != list(range(world)):
        return None  # not one coordinate per rank of the new mesh
    holders = [rank for rank, m in enumerate(members) if m.held == newest]
    old_sizes = {members[rank].old_size for rank in holders}
    if len(old_sizes) != 1 or not 0 < min(old_sizes) <= world:
        return None  # holders of different last meshes, or more shards than ranks to hold them
    source_of: dict[int, int] = {}  # a shard of the last round's mesh -> the rank that gives it
    for rank in holders:
        source_of.setdefault(members[rank].old_coordinate, rank)
    if set(source_of) != set(range(old_sizes.pop())):
        return None  # a shard of the newest step went with its node: restore from a snapshot
    assert mesh is not None, "every rank is able"
    rank = dist.get_rank()
    lacking = [r for r in range(world) if r not in holders]
    entries: list[Any] = []
    received = 0
    if rank in holders:
        assert old is not None, "a holder held its last round's state"
        if lacking:
            send_state(old, lacking, holders.index(rank), len(holders), device, sharded=[])
        structure = old
        entries = _dtensors(old)
    else:
        structure, received = receive_state(app_state.keys(), holders, device, sharded=entries)
    plan = _Plan(members, source_of, rank)
    rows, from_peers = plan.exchange(entries, device)
    shards = iter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(entry.shape),
                                     stride=_contiguous_stride(entry.shape))
                  for local, entry in zip(rows, entries))
    for key, state in _replaced(structure, shards).items():
        app_state[key].load_state_dict(state)
    sources = tuple(sorted(plan.sources)) if rank not in holders else ()
    return Healed(step=newest, sources=sources, bytes=received + from_peers, seconds=time.perf_counter() - started)


class _Plan:
    """Which rows of each sharded tensor go from which rank to which: rank ``r`` of the new mesh
    needs ``torch.chunk``'s rows of its coordinate; each range of them held by the last round's
    shard ``o`` comes from ``source_of[o]``, every rank computing the same messages in the same
    order (their tags)."""

    def __init__(self, members: list[_Member], source_of: dict[int, int], rank: int) -> None:
        self._old_size = members[source_of[0]].old_size
        self._new_size = len(members)
        self._rank_of_new = {m.new_coordinate: r for r, m in enumerate(members)}
        self._source_of = source_of
        self._rank = rank
        self._me = members[rank]
        self.sources: set[int] = set()
        """The ranks this rank received rows from."""

    def exchange(self, entries: list[Any], device: torch.device) -> tuple[list[torch.Tensor], int]:
        """This rank's new rows of each of ``entries`` (its DTensors of the last round, or the
        ShardedEntry a holder described), and the bytes it received from peers."""
        operations: list[dist.P2POp] = []
        rows, received, tag = [], 0, _FIRST_ROWS_TAG
        for entry in entries:
            shape = tuple(entry.shape)
            mine = _chunk_rows(shape[0], self._new_size, self._me.new_coordinate)
            local = torch.empty((mine[1] - mine[0], *shape[1:]), dtype=entry.dtype, device=device)
            held = self._held_rows(entry, shape) if isinstance(entry, DTensor) else None
            for coordinate in range(self._new_size):
                wanted = _chunk_rows(shape[0], self._new_size, coordinate)
                destination = self._rank_of_new[coordinate]
                for shard, source in sorted(self._source_of.items()):
                    given = _chunk_rows(shape[0], self._old_size, shard)
                    start, end = max(wanted[0], given[0]), min(wanted[1], given[1])
                    if start >= end:
                        continue
                    tag += 1
                    if source == self._rank:
                        assert held is not None, "a source holds its shard"
                        part = held[start - given[0]:end - given[0]]
                        if destination == self._rank:
                            local[start - mine[0]:end - mine[0]].copy_(part)
                        else:
                            operations.append(dist.P2POp(dist.isend, part, destination, tag=tag))
                    elif destination == self._rank:
                        part = local[start - mine[0]:end - mine[0]]
                        operations.append(dist.P2POp(dist.irecv, part, source, tag=tag))
                        received += part.numel() * part.element_size()
                        self.sources.add(source)
            rows.append(local)
        run_all(operations)
        return rows, received

    def _held_rows(self, tensor: DTensor, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's rows of ``tensor`` from the last round, checked against ``torch.chunk``'s."""
        local = tensor.to_local().detach().contiguous()
        start, end = _chunk_rows(shape[0], self._old_size, self._me.old_coordinate)
        if tuple(local.shape) != (end - start, *shape[1:]):
            raise RestoreError(f"a shard of shape {tuple(local.shape)} of a tensor of shape {shape} at coordinate "
                               f"{self._me.old_coordinate} of {self._old_size}: not torch.chunk's rows, which "
                               "healing from memory re-lays")
        return local


def _chunk_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """The rows [start, end) that ``torch.chunk(rows, parts)`` gives part ``index`` (empty past the end)."""
    size = -(-rows // parts)
    return min(index * size, rows), min((index + 1) * size, rows)


def _row_sharded_mesh(state: Any) -> DeviceMesh | None:
    """The one-dimensional mesh every DTensor of ``state`` is sharded on by rows, or None (none,
    several, or another layout)."""
    found = _dtensors(state)
    meshes = {t.device_mesh for t in found}
    if len(meshes) != 1 or any(t.placements != (Shard(0),) or not t.shape for t in found):
        return None
    (mesh,) = meshes
    return mesh if mesh.ndim == 1 else None


def _dtensors(state: Any) -> list[DTensor]:
    """``state``'s DTensors, in the order :func:`agent.heal.encode` meets them."""
    return [value for value in leaves(state) if isinstance(value, DTensor)]


def _replaced(value: Any, shards: Iterator[DTensor]) -> Any:
    """``value`` with each DTensor or ShardedEntry, in order, replaced by the next of ``shards``."""
    if isinstance(value, DTensor | ShardedEntry):
        return next(shards)
    if isinstance(value, Mapping):
        return {key: _replaced(item, shards) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_replaced(item, shards) for item in value)
    if isinstance(value, list):
        return [_replaced(item, shards) for item in value]
    return value


def _coordinate(mesh: DeviceMesh | None) -> int:
    coordinate = mesh.get_coordinate() if mesh is not None else None
    return coordinate[0] if coordinate else -1


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, strides = 1, []
    for size in reversed(shape):
        strides.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(strides))


def _all_gather(member: _Member, device: torch.device) -> list[_Member]:
    mine = torch.tensor(list(member), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [_Member(*(int(v) for v in t.tolist())) for t in gathered]
