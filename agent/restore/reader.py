"""Executes a read plan: each file mmap'ed once, a thread pool copying straight from the mapping
into the destination tensors (torch's copy releases the GIL), CUDA destinations staged through
a small ring of pinned host buffers with asynchronous host-to-device copies."""

from __future__ import annotations

import functools
import io
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from agent.restore.plan import CopyOp

PAGE = mmap.PAGESIZE


def default_io_threads() -> int:
    """Enough threads to keep storage busy (cold) and every core copying (warm)."""
    return min(32, max(4, 2 * (os.cpu_count() or 1)))


class SnapshotFiles:
    """The snapshot's files, each opened and mapped once, privately and lazily."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._maps: dict[str, mmap.mmap] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def path(self, location: str) -> Path:
        return self._root / location

    def size(self, location: str) -> int:
        """The file's size in bytes (stat'ed once: many tensors share one batched file); raises
        FileNotFoundError when it is missing."""
        if location not in self._sizes:
            self._sizes[location] = self.path(location).stat().st_size
        return self._sizes[location]

    def mapping(self, location: str) -> mmap.mmap:
        with self._lock:
            if location not in self._maps:
                with open(self.path(location), "rb") as f:
                    # A private writable mapping: torch.frombuffer wants a writable buffer, and
                    # nothing is ever written, so every page stays shared with the page cache.
                    self._maps[location] = mmap.mmap(
                        f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                    )
            return self._maps[location]

    def close(self) -> None:
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()


def read_ops(
    ops: Sequence[CopyOp],
    targets: Sequence[torch.Tensor],
    files: SnapshotFiles,
    *,
    io_threads: int,
    checks: Sequence[tuple[tuple[str, int], Callable[[], int]]] = (),
) -> int:
    """Run every copy; returns the bytes read from storage. Ops go out in file order so that
    each file is read front to back; ``checks`` (keyed by file and byte offset) run in the same
    pool beside the copies of their bytes, and the first one that raises stops the restore."""
    stagers: dict[int, _CudaStager] = {}

    def run(op: CopyOp) -> int:
        dst = targets[op.target][_region(op.dst_start, op.sizes)]
        if dst.is_cuda:
            thread = threading.get_ident()
            if thread not in stagers:  # one ring of pinned buffers per thread, made once
                stagers[thread] = _CudaStager(dst.device)
            stagers[thread].copy(dst, lambda out: _copy_from_storage(op, files, out))
        else:
            _copy_from_storage(op, files, dst)
        return op.nbytes

    # A check sorts just before the copies of the bytes it covers; the copies go in file order.
    keyed = [((op.chunk.location, byte_span(op)[0], 1), True, functools.partial(run, op)) for op in ops]
    keyed += [((location, offset, 0), False, check) for (location, offset), check in checks]
    keyed.sort(key=lambda job: job[0])
    jobs = [job for _, _, job in keyed]
    try:
        if io_threads <= 1 or len(jobs) <= 1:
            done = [job() for job in jobs]
        else:
            pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="torchrevive-read")
            try:
                done = list(pool.map(lambda job: job(), jobs))
            finally:
                pool.shutdown(cancel_futures=True)
    finally:
        for stager in stagers.values():
            stager.finish()
    return sum(n for (_, is_copy, _), n in zip(keyed, done) if is_copy)


def _copy_from_storage(op: CopyOp, files: SnapshotFiles, dst: torch.Tensor) -> None:
    chunk = op.chunk
    mapping = files.mapping(chunk.location)
    if not chunk.raw:
        payload = mapping[chunk.byte_offset : chunk.byte_offset + chunk.byte_length]
        whole = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
        dst.copy_(whole.reshape(chunk.sizes)[_region(op.src_start, op.sizes)])
        return
    start_byte, end_byte = byte_span(op)
    src = torch.frombuffer(mapping, dtype=chunk.dtype, count=(end_byte - start_byte) // chunk.dtype.itemsize,
                           offset=start_byte)
    dst.copy_(src.as_strided(op.sizes, _row_major_strides(chunk.sizes)))
    del src
    release_pages(mapping, start_byte, end_byte)


def release_pages(mapping: mmap.mmap, start: int, end: int) -> None:
    """Drop copied pages from this process's mapping: the page cache keeps them, and the process's
    resident set stays at the destination tensors instead of growing by the snapshot."""
    lo = start // PAGE * PAGE
    hi = min(len(mapping), math.ceil(end / PAGE) * PAGE)
    if hi > lo:
        mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def byte_span(op: CopyOp) -> tuple[int, int]:
    """The bytes of its file (start, end exclusive) that an operation reads."""
    chunk = op.chunk
    if not chunk.raw:
        return chunk.byte_offset, chunk.byte_offset + chunk.byte_length
    strides = _row_major_strides(chunk.sizes)
    first = sum(s * st for s, st in zip(op.src_start, strides))
    last = sum((s + n - 1) * st for s, n, st in zip(op.src_start, op.sizes, strides))
    return chunk.byte_offset + first * chunk.dtype.itemsize, chunk.byte_offset + (last + 1) * chunk.dtype.itemsize


def _region(starts: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    """The index that selects ``sizes`` elements from ``starts`` in every dimension."""
    return tuple(slice(start, start + size) for start, size in zip(starts, sizes))


def _row_major_strides(sizes: Iterable[int]) -> tuple[int, ...]:
    strides: list[int] = []
    acc = 1
    for size in reversed(tuple(sizes)):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


class _CudaStager:
    """One thread's ring of pinned host buffers and its copy stream: storage -> pinned buffer
    (CPU copy) -> device (asynchronous), with the next buffer filled while the last one uploads."""

    RING = 2
    BUFFER_BYTES = 64 << 20

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device=device)
        self._buffers = [torch.empty(self.BUFFER_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(self.RING)]
        self._events: list[torch.cuda.Event | None] = [None] * self.RING
        self._next = 0

    def copy(self, dst: torch.Tensor, fill: Callable[[torch.Tensor], None]) -> None:
        """Upload ``dst``'s bytes: ``fill`` writes them into a pinned staging tensor."""
        nbytes = dst.numel() * dst.element_size()
        slot = self._next
        self._next = (slot + 1) % self.RING
        if nbytes > self.BUFFER_BYTES:
            staging = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True)
        else:
            if self._events[slot] is not None:
                self._events[slot].synchronize()
            staging = self._buffers[slot][:nbytes].view(dst.dtype).view(dst.shape)
        fill(staging)
        with torch.cuda.stream(self._stream):
            dst.copy_(staging, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        if nbytes > self.BUFFER_BYTES:
            event.synchronize()
        else:
            self._events[slot] = event

    def finish(self) -> None:
        self._stream.synchronize()
