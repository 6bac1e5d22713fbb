"""The read plan, pure: boxes x chunks -> copies, checked against plain tensor slicing."""

from __future__ import annotations

import math
import random

import pytest
import torch

from agent.restore.manifest import StoredChunk, StoredTensor
from agent.restore.plan import Box, CoverageError, plan_copies, split_op, stripe


def grid_chunks(shape: tuple[int, ...], cuts: list[list[int]]) -> list[Box]:
    """Boxes of a grid: cuts[d] are the split points along dim d."""
    boxes = [Box((), ())]
    for dim, size in enumerate(shape):
        points = [0, *sorted(set(c for c in cuts[dim] if 0 < c < size)), size]
        boxes = [Box((*b.offsets, lo), (*b.sizes, hi - lo)) for b in boxes for lo, hi in zip(points, points[1:])]
    return boxes


def as_stored(shape, boxes) -> StoredTensor:
    chunks = tuple(
        StoredChunk(b.offsets, b.sizes, f"file{i}", 0, b.numel * 4, torch.float32, "buffer_protocol")
        for i, b in enumerate(boxes)
    )
    return StoredTensor(tuple(shape), torch.float32, chunks, False)


def execute(ops, stored_data: dict[str, torch.Tensor], targets: list[torch.Tensor]) -> int:
    """Run a plan with plain slicing (what the reader does with mmap'ed bytes)."""
    read = 0
    for op in ops:
        src = stored_data[op.chunk.location][tuple(slice(s, s + n) for s, n in zip(op.src_start, op.sizes))]
        targets[op.target][tuple(slice(s, s + n) for s, n in zip(op.dst_start, op.sizes))].copy_(src)
        read += op.nbytes
    return read


@pytest.mark.parametrize("seed", range(40))
def test_random_boxes_read_exactly_their_elements(seed):
    rng = random.Random(seed)
    ndim = rng.randint(1, 3)
    shape = tuple(rng.randint(1, 9) for _ in range(ndim))
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    chunks = grid_chunks(shape, [[rng.randint(0, s) for _ in range(rng.randint(0, 3))] for s in shape])
    stored = as_stored(shape, chunks)
    data = {c.location: full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))].contiguous() for c in stored.chunks}
    targets_boxes = []
    for _ in range(rng.randint(1, 3)):
        lo = [rng.randint(0, s - 1) for s in shape]
        targets_boxes.append(Box(tuple(lo), tuple(rng.randint(1, s - l) for s, l in zip(shape, lo))))
    ops = plan_copies(stored, targets_boxes, max_op_bytes=rng.choice([4, 64, 1 << 20]))
    targets = [torch.full(b.sizes, -1.0) for b in targets_boxes]
    read = execute(ops, data, targets)
    for box, got in zip(targets_boxes, targets):
        assert torch.equal(got, full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))])
    assert read == sum(b.numel for b in targets_boxes) * 4


def test_zero_dim_and_empty_boxes():
    scalar = as_stored((), [Box((), ())])
    [op] = plan_copies(scalar, [Box((), ())], max_op_bytes=1)
    assert (op.sizes, op.nbytes) == ((), 4)
    empty = as_stored((0, 3), [Box((0, 0), (0, 3))])
    assert plan_copies(empty, [Box((0, 0), (0, 3))], max_op_bytes=1) == []


def test_gap_in_stored_chunks_is_an_error():
    stored = as_stored((4,), [Box((0,), (2,))])
    with pytest.raises(CoverageError, match="cover 2 of the 4 elements"):
        plan_copies(stored, [Box((0,), (4,))], max_op_bytes=1 << 20)


def test_large_copies_split_by_rows():
    stored = as_stored((100, 10), [Box((0, 0), (100, 10))])
    [op] = plan_copies(stored, [Box((0, 0), (100, 10))], max_op_bytes=1 << 20)
    pieces = split_op(op, max_op_bytes=400)
    assert [p.sizes for p in pieces] == [(10, 10)] * 10
    assert [p.src_start for p in pieces] == [(r, 0) for r in range(0, 100, 10)]


@pytest.mark.parametrize("sizes, max_op_bytes", [((1, 1000), 400), ((3, 2, 500), 400), ((2, 1, 7), 4), ((1, 1), 1)])
def test_every_piece_fits_when_one_row_is_larger_than_the_limit(sizes, max_op_bytes):
    """A CUDA destination is staged in pinned buffers of a fixed size: every piece must fit one."""
    stored = as_stored(sizes, [Box((0,) * len(sizes), sizes)])
    [op] = plan_copies(stored, [Box((0,) * len(sizes), sizes)], max_op_bytes=1 << 20)
    pieces = split_op(op, max_op_bytes)
    assert all(p.nbytes <= max(max_op_bytes, 4) for p in pieces)
    data = {"file0": torch.arange(math.prod(sizes), dtype=torch.float32).reshape(sizes)}
    target = torch.zeros(sizes)
    assert execute(pieces, data, [target]) == op.nbytes
    assert torch.equal(target, data["file0"])


def test_stripes_cover_the_rows_once():
    boxes = [stripe((10, 3), r, 4) for r in range(4)]
    assert [b.sizes[0] for b in boxes] == [2, 3, 2, 3]
    assert [b.offsets[0] for b in boxes] == [0, 2, 5, 7]
