"""How the ranks of a save or a restore agree: every rank's value, the first error, rank 0's
verdict. Each is a no-op outside a process group; ``group`` None means the default group."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def first_error(error: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """The error of the lowest rank that has one (the same answer on every rank), else None."""
    return next((e for e in gather(error, group) if e is not None), None)


def from_rank0(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's ``value``, on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return box[0]


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def own_group(timeout: timedelta | None = None) -> dist.ProcessGroup | None:
    """A new gloo group of every rank, for a background save whose collectives must never
    interleave with the training's (every rank makes it at the same point); None outside a
    process group."""
    return dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
