"""Destination boxes x stored chunks -> copy operations. Pure data, no I/O.

A *box* is a block of a global tensor: per-dimension ``offsets`` and ``sizes``. Each destination
local tensor covers one box (the whole tensor, a DTensor's local shard, a ShardedTensor's local
shard); each stored chunk covers another. Every non-empty intersection becomes one CopyOp (or a
few, when it is large), and nothing outside the intersections is ever read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agent.restore.manifest import StoredChunk, StoredTensor


@dataclass(frozen=True)
class Box:
    """A block of a global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common block, or None when they do not overlap (or one is empty)."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        ends = tuple(
            min(a + s, b + t) for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )
        if any(e <= s for s, e in zip(starts, ends)) or self.numel == 0 or other.numel == 0:
            return None
        return Box(starts, tuple(e - s for s, e in zip(starts, ends)))


@dataclass(frozen=True)
class CopyOp:
    """Copy ``sizes`` elements from a stored chunk (starting at ``src_start`` inside the chunk)
    into destination tensor number ``target`` (starting at ``dst_start`` inside it)."""

    chunk: StoredChunk
    target: int
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes this operation reads from storage."""
        if not self.chunk.raw:
            return self.chunk.byte_length
        return math.prod(self.sizes) * self.chunk.dtype.itemsize


class CoverageError(ValueError):
    """The stored chunks leave part of a destination box uncovered (or cover it twice)."""


def chunk_box(chunk: StoredChunk) -> Box:
    return Box(chunk.offsets, chunk.sizes)


def plan_copies(stored: StoredTensor, targets: Sequence[Box], *, max_op_bytes: int) -> list[CopyOp]:
    """The copies that fill every target box from the stored chunks.

    Raises CoverageError when a target box is not covered exactly once.
    """
    ops: list[CopyOp] = []
    for index, target in enumerate(targets):
        covered = 0
        for chunk in stored.chunks:
            common = target.intersect(chunk_box(chunk))
            if common is None:
                continue
            covered += common.numel
            op = CopyOp(
                chunk=chunk,
                target=index,
                src_start=tuple(c - o for c, o in zip(common.offsets, chunk.offsets)),
                dst_start=tuple(c - o for c, o in zip(common.offsets, target.offsets)),
                sizes=common.sizes,
            )
            ops.extend(split_op(op, max_op_bytes) if chunk.raw else [op])
        if covered != target.numel:
            raise CoverageError(
                f"the stored chunks cover {covered} of the {target.numel} elements of box "
                f"offsets={list(target.offsets)} sizes={list(target.sizes)}"
            )
    return ops


def split_op(op: CopyOp, max_op_bytes: int) -> list[CopyOp]:
    """Split a large copy into pieces of at most ``max_op_bytes`` (one element at the least) so
    that threads share big tensors: along its first dimension longer than 1, and where a single
    index of that one is still too large, along the next ones."""
    dim = next((d for d, n in enumerate(op.sizes) if n > 1), None)
    if dim is None or op.nbytes <= max_op_bytes:
        return [op]
    step = max(1, max_op_bytes // (op.nbytes // op.sizes[dim]))
    pieces = [_narrowed(op, dim, start, min(step, op.sizes[dim] - start)) for start in range(0, op.sizes[dim], step)]
    return [piece for part in pieces for piece in split_op(part, max_op_bytes)]


def _narrowed(op: CopyOp, dim: int, start: int, length: int) -> CopyOp:
    """The part of ``op`` with indexes ``start``..``start + length`` (relative to the operation)
    along ``dim``."""

    def shifted(starts: tuple[int, ...]) -> tuple[int, ...]:
        return (*starts[:dim], starts[dim] + start, *starts[dim + 1 :])

    sizes = (*op.sizes[:dim], length, *op.sizes[dim + 1 :])
    return replace(op, src_start=shifted(op.src_start), dst_start=shifted(op.dst_start), sizes=sizes)


def stripe(shape: tuple[int, ...], rank: int, world_size: int) -> Box:
    """Rank's share of a replicated tensor: a near-equal block of rows along dim 0."""
    rows = shape[0]
    start = rows * rank // world_size
    end = rows * (rank + 1) // world_size
    return Box((start, *([0] * (len(shape) - 1))), (end - start, *shape[1:]))
