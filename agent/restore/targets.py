"""Destination state -> the boxes each rank owns and the local tensors that receive them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from agent.restore.manifest import StoredTensor
from agent.restore.plan import Box

try:  # ShardedTensor is deprecated in torch; restore it while torch still provides it.
    from torch.distributed._shard.sharded_tensor import ShardedTensor
except ImportError:  # pragma: no cover - depends on the torch release
    ShardedTensor = None  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class Destination:
    """Where one stored tensor goes on this rank: ``value`` is what the state dict holds (a
    tensor, DTensor or ShardedTensor); ``local_tensors[i]`` receives global box ``boxes[i]``."""

    value: Any
    local_tensors: tuple[torch.Tensor, ...]
    boxes: tuple[Box, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def is_plain(self) -> bool:
        return not isinstance(self.value, DTensor) and not _is_sharded_tensor(self.value)


def is_tensor_value(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or _is_sharded_tensor(value)


def destination_of(value: Any) -> Destination:
    """The boxes this rank owns of a destination tensor of any supported kind."""
    if isinstance(value, DTensor):
        chunks = value.__create_chunk_list__()
        assert len(chunks) == 1, "a DTensor has one local shard"
        box = Box(tuple(chunks[0].offsets), tuple(chunks[0].sizes))
        return Destination(value, (value.to_local(),), (box,), tuple(value.shape), value.dtype)
    if _is_sharded_tensor(value):
        shards = value.local_shards()
        boxes = tuple(Box(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in shards)
        return Destination(value, tuple(s.tensor for s in shards), boxes, tuple(value.size()), value.dtype)
    shape = tuple(value.shape)
    return Destination(value, (value,), (Box((0,) * len(shape), shape),), shape, value.dtype)


def allocate(stored: StoredTensor, template: torch.Tensor | None) -> torch.Tensor:
    """A new destination for state the destination does not have yet (Adam's moments before the
    first step): shaped like ``template`` (sharded alike) when the shapes agree, else plain."""
    if template is not None and tuple(template.shape) == stored.shape:
        return torch.empty_like(template, dtype=stored.dtype)
    return torch.empty(stored.shape, dtype=stored.dtype)


def optimizer_templates(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in the order ``Optimizer.state_dict()`` numbers them."""
    return [p for group in optimizer.param_groups for p in group["params"]]


_OPTIM_STATE_PATH = re.compile(r"^[^/]+/state/(\d+)/[^/]+$")


def template_for(path: str, templates: list[torch.Tensor]) -> torch.Tensor | None:
    """The parameter whose per-parameter optimizer state lives at ``path``, if any."""
    match = _OPTIM_STATE_PATH.match(path)
    if match and int(match.group(1)) < len(templates):
        return templates[int(match.group(1))]
    return None


def _is_sharded_tensor(value: Any) -> bool:
    return ShardedTensor is not None and isinstance(value, ShardedTensor)
