"""Executes a read plan: a thread pool of positional reads (``preadv``, which releases the GIL)
from each file straight into the destination tensors' memory; CUDA destinations are read into a
bounded set of pinned host buffers and copied to the device asynchronously on a side stream.

Positional reads rather than memory maps: nothing is charged against the commit limit (a
private writable mapping is, and fails under ``vm.overcommit_memory=2``), a file truncated or
failing while it is read gives a short read or an error (a mapping gives SIGBUS, the death of
the process), and a read costs less CPU than faulting the same pages in and releasing them again
(about 20% less, warm, measured side by side). A strided copy (a block of columns) gathers its
rows with one ``preadv`` per few hundred rows; the small gaps between rows go to a scratch buffer.
"""

from __future__ import annotations

import ctypes
import functools
import io
import math
import mmap
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from agent.errors import RestoreError
from agent.restore.plan import CopyOp, narrow_op, split_op

IOV_MAX = 1024
"""Buffers per ``preadv`` call (Linux's UIO_MAXIOV)."""
SKIP_BYTES = 64 << 10
"""Gaps between the rows of a strided copy up to this size are read into a scratch buffer (one
call for many rows); larger gaps start a new read."""
SMALL_RUN_BYTES = 512
"""Strided copies with contiguous runs shorter than this read their whole byte span, a slab of
rows at a time, and copy the elements out of it: one buffer per run would cost more than the
gaps. Longer runs are gathered straight into the destination."""
SLAB_BYTES = 4 << 20
DEFAULT_PINNED_MB = 256
"""Pinned host memory a rank may use to stage CUDA destinations, unless told otherwise."""
MAX_STAGING_BYTES = 16 << 20

# SnapshotFiles.mapping is read-only (no commit charge); torch.frombuffer warns about that once,
# for the DCP reader's zero-copy views, which are only ever read.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=r"agent\.restore\.")


class StorageReadError(RestoreError):
    """A snapshot file could not be opened, ended early or failed while being read."""

    def __init__(self, location: str, message: str) -> None:
        super().__init__(message)
        self.location = location


def default_io_threads() -> int:
    """One reader per core, at least 2: page-cache copies are CPU-bound, and more threads than
    cores only contend for them (measured warm and cold, see README); 32 at most."""
    return min(32, max(2, os.cpu_count() or 1))


class SnapshotFiles:
    """The snapshot's files, opened read-only and lazily (once per reading thread)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._fds: dict[tuple[int, str], int] = {}
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

    def fd(self, location: str) -> int:
        """This thread's read-only descriptor of the file (one per thread: the kernel keeps its
        readahead state per open file, and threads reading apart would confuse a shared one);
        StorageReadError naming the file when it cannot be opened."""
        key = (threading.get_ident(), location)
        with self._lock:
            if key not in self._fds:
                try:
                    self._fds[key] = os.open(self.path(location), os.O_RDONLY | os.O_CLOEXEC)
                except OSError as exc:
                    raise StorageReadError(location, f"{self.path(location)}: cannot be opened ({exc.strerror}) "
                                           "while being restored") from None
            return self._fds[key]

    def read_into(self, location: str, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` with the file's bytes from ``offset`` on; StorageReadError naming the
        file and the bytes when it ends early (truncated) or the read fails."""
        fd, wanted = self.fd(location), sum(len(b) for b in buffers)
        done = 0
        try:
            while done < wanted:
                got = os.preadv(fd, _advanced(buffers, done), offset + done)
                if got == 0:
                    raise StorageReadError(location, f"{self.path(location)}: ends at byte {offset + done}, before "
                                           f"bytes {offset}..{offset + wanted} could be read (truncated while "
                                           "being restored)")
                done += got
        except OSError as exc:
            raise StorageReadError(location, f"{self.path(location)}: reading bytes {offset}..{offset + wanted} "
                                   f"failed ({exc.strerror or exc})") from exc

    def read(self, location: str, offset: int, length: int) -> bytearray:
        """``length`` bytes of the file from ``offset`` on (see :meth:`read_into`)."""
        payload = bytearray(length)
        self.read_into(location, offset, [memoryview(payload)])
        return payload

    def mapping(self, location: str) -> mmap.mmap:
        """A read-only shared mapping of the whole file (no commit charge), made once."""
        with self._lock:
            if location not in self._maps:
                with open(self.path(location), "rb") as f:
                    self._maps[location] = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            return self._maps[location]

    def close(self) -> None:
        for mapping in self._maps.values():
            mapping.close()
        for fd in self._fds.values():
            os.close(fd)
        self._maps.clear()
        self._fds.clear()


def _advanced(buffers: list[memoryview], skip: int) -> list[memoryview]:
    """``buffers`` without their first ``skip`` bytes."""
    if skip == 0:
        return buffers
    rest = []
    for buffer in buffers:
        if skip >= len(buffer):
            skip -= len(buffer)
        else:
            rest.append(buffer[skip:])
            skip = 0
    return rest


def read_ops(
    ops: Sequence[CopyOp],
    targets: Sequence[torch.Tensor],
    files: SnapshotFiles,
    *,
    io_threads: int,
    pinned_bytes: int = DEFAULT_PINNED_MB << 20,
    checks: Sequence[tuple[tuple[str, int], Callable[[], int]]] = (),
) -> int:
    """Run every copy; returns the bytes read from storage. Ops go out in file order so that
    each file is read front to back; ``checks`` (keyed by file and byte offset) run in the same
    pool beside the copies of their bytes, and the first one that raises stops the restore.
    CUDA destinations are staged through at most ``pinned_bytes`` of pinned host memory."""
    devices = sorted({t.device for t in targets if t.is_cuda}, key=str)
    staging = _CudaStaging(devices, pinned_bytes, io_threads) if devices else None

    def run(op: CopyOp) -> int:
        dst = targets[op.target][_region(op.dst_start, op.sizes)]
        if dst.is_cuda:
            assert staging is not None
            staging.upload(op, dst, files)
        else:
            copy_from_storage(op, files, dst)
        return op.nbytes

    # A check sorts just before the copies of the bytes it covers; the copies go in file order.
    keyed = [((op.chunk.location, byte_span(op)[0], 1), True, functools.partial(run, op)) for op in ops]
    keyed += [((location, offset, 0), False, check) for (location, offset), check in checks]
    keyed.sort(key=lambda job: job[0])
    jobs = [job for _, _, job in keyed]
    try:
        done = _run_all(jobs, io_threads)
    finally:
        if staging is not None:
            staging.finish()
    return sum(n for (_, is_copy, _), n in zip(keyed, done) if is_copy)


def _run_all(jobs: list[Callable[[], int]], io_threads: int) -> list[int]:
    """Every job's result, in order; the first exception stops the rest."""
    if io_threads <= 1 or len(jobs) <= 1:
        return [job() for job in jobs]
    pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="torchrevive-read")
    try:
        return list(pool.map(lambda job: job(), jobs))
    finally:
        pool.shutdown(cancel_futures=True)


def copy_from_storage(op: CopyOp, files: SnapshotFiles, dst: torch.Tensor) -> None:
    """Fill the CPU tensor ``dst`` (shaped ``op.sizes``) with the operation's stored elements."""
    chunk = op.chunk
    if not chunk.raw:
        payload = files.read(chunk.location, chunk.byte_offset, chunk.byte_length)
        whole = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
        dst.copy_(whole.reshape(chunk.sizes)[_region(op.src_start, op.sizes)])
        return
    runs = _runs(op, dst)
    if runs is None or (len(runs[0]) > 1 and runs[2] < SMALL_RUN_BYTES):
        _copy_through_slabs(op, files, dst)
        return
    src_offsets, dst_offsets, run_bytes = runs
    memory = _memory_of(dst, dst_offsets[-1] + run_bytes)
    for offset, buffers in _gathers(src_offsets, dst_offsets, run_bytes, memory):
        files.read_into(chunk.location, offset, buffers)


def _copy_through_slabs(op: CopyOp, files: SnapshotFiles, dst: torch.Tensor) -> None:
    """Read the operation's byte span a slab of first-dimension indexes at a time into a buffer
    and copy the elements out of it with a strided view."""
    strides, itemsize = _row_major_strides(op.chunk.sizes), op.chunk.dtype.itemsize
    step = max(1, SLAB_BYTES // (strides[0] * itemsize))
    buffer = torch.empty(0, dtype=torch.uint8)
    for start in range(0, op.sizes[0], step):
        piece = narrow_op(op, 0, start, min(step, op.sizes[0] - start))
        lo, hi = byte_span(piece)
        if buffer.numel() < hi - lo:
            buffer = torch.empty(hi - lo, dtype=torch.uint8)
        files.read_into(op.chunk.location, lo, [_memory_of(buffer, hi - lo)])
        dst[start : start + piece.sizes[0]].copy_(buffer[: hi - lo].view(op.chunk.dtype).as_strided(piece.sizes, strides))


def _memory_of(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """The first ``nbytes`` of a CPU tensor's memory, writable, from its first element on."""
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _runs(op: CopyOp, dst: torch.Tensor) -> tuple[list[int], list[int], int] | None:
    """The operation as runs of bytes contiguous both in its file and in ``dst``: the file offset
    and the byte offset in ``dst`` of each run (in file order), and the run length. None when
    ``dst``'s last dimension is not contiguous."""
    sizes, itemsize = op.sizes, op.chunk.dtype.itemsize
    src_strides = _row_major_strides(op.chunk.sizes)
    inner = _contiguous_from(sizes, dst.stride())
    if inner == len(sizes) and sizes:
        return None
    # The outer dimensions: those before the trailing block that is whole in the chunk and dense in dst.
    whole = next((d for d in range(len(sizes) - 1, 0, -1) if sizes[d] != op.chunk.sizes[d]), 0)
    outer = max(inner, whole)
    base = op.chunk.byte_offset + itemsize * sum(s * st for s, st in zip(op.src_start, src_strides))
    run_bytes = itemsize * math.prod(sizes[outer:])
    src = _grid_offsets(sizes[:outer], [st * itemsize for st in src_strides[:outer]], base)
    dst_offsets = _grid_offsets(sizes[:outer], [st * itemsize for st in dst.stride()[:outer]], 0)
    return src, dst_offsets, run_bytes


def _contiguous_from(sizes: Sequence[int], strides: Sequence[int]) -> int:
    """The first dimension from which on a tensor of ``sizes``/``strides`` is dense (row-major)."""
    expected = 1
    for dim in range(len(sizes) - 1, -1, -1):
        if sizes[dim] != 1 and strides[dim] != expected:
            return dim + 1
        expected *= sizes[dim]
    return 0


def _grid_offsets(sizes: Sequence[int], strides: Sequence[int], base: int) -> list[int]:
    """``base + sum(index[d] * strides[d])`` for every index of a grid of ``sizes``, row-major."""
    offsets = [base]
    for size, stride in zip(sizes, strides):
        offsets = [offset + i * stride for offset in offsets for i in range(size)]
    return offsets


def _gathers(
    src_offsets: list[int], dst_offsets: list[int], run_bytes: int, memory: memoryview
) -> Iterable[tuple[int, list[memoryview]]]:
    """Group runs into ``preadv`` calls: (file offset, buffers) with each small gap between runs
    read into a scratch buffer, a large gap or a full call starting the next group."""
    scratch = memoryview(bytearray(SKIP_BYTES)) if len(src_offsets) > 1 else memoryview(b"")
    start, buffers, end = src_offsets[0], [], src_offsets[0]
    for src, dst in zip(src_offsets, dst_offsets):
        gap = src - end
        if gap > SKIP_BYTES or len(buffers) + 2 > IOV_MAX:
            yield start, buffers
            start, buffers = src, []
        elif gap:
            buffers.append(scratch[:gap])
        buffers.append(memory[dst : dst + run_bytes])
        end = src + run_bytes
    yield start, buffers


def byte_span(op: CopyOp) -> tuple[int, int]:
    """The bytes of its file (start, end exclusive) that an operation reads."""
    chunk = op.chunk
    if not chunk.raw:
        return chunk.byte_offset, chunk.byte_offset + chunk.byte_length
    strides = _row_major_strides(chunk.sizes)
    first = sum(s * st for s, st in zip(op.src_start, strides))
    last = sum((s + n - 1) * st for s, n, st in zip(op.src_start, op.sizes, strides))
    return chunk.byte_offset + first * chunk.dtype.itemsize, chunk.byte_offset + (last + 1) * chunk.dtype.itemsize


def release_pages(mapping: mmap.mmap, start: int, end: int) -> None:
    """Drop copied pages from this process's mapping: the page cache keeps them, and the process's
    resident set stays at the destination tensors instead of growing by the snapshot."""
    lo = start // mmap.PAGESIZE * mmap.PAGESIZE
    hi = min(len(mapping), math.ceil(end / mmap.PAGESIZE) * mmap.PAGESIZE)
    if hi > lo:
        mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


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


def staging_layout(pinned_bytes: int, io_threads: int) -> tuple[int, int]:
    """(number of pinned buffers, bytes each) for a budget of ``pinned_bytes``: two buffers per
    thread where the budget allows (one filling while the other uploads), each a power of two
    (torch's pinned allocator rounds up to one) of at most MAX_STAGING_BYTES, at least two."""
    if pinned_bytes < 2:
        raise ValueError(f"a pinned budget of {pinned_bytes} bytes cannot hold two staging buffers")
    share = min(MAX_STAGING_BYTES, pinned_bytes // (2 * max(1, io_threads)) or 1, pinned_bytes // 2)
    buffer_bytes = 1 << (share.bit_length() - 1)
    return min(2 * max(1, io_threads), pinned_bytes // buffer_bytes), buffer_bytes


@dataclass
class _Slot:
    """A pinned buffer (made on first use) and the event of its last upload."""

    buffer: torch.Tensor | None = None
    uploaded: torch.cuda.Event | None = None


class _CudaStaging:
    """Pinned host buffers shared by the pool's threads (``staging_layout``: never more than the
    budget) and a copy stream per device that starts after the work already queued on the
    caller's current stream (which may still be writing the destination tensors)."""

    def __init__(self, devices: Sequence[torch.device], pinned_bytes: int, io_threads: int) -> None:
        count, self.buffer_bytes = staging_layout(pinned_bytes, io_threads)
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(_Slot())
        self._streams = {}
        for device in devices:
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            self._streams[device] = stream

    def upload(self, op: CopyOp, dst: torch.Tensor, files: SnapshotFiles) -> None:
        """Copy an operation's elements into the CUDA tensor ``dst`` (shaped ``op.sizes``), in
        pieces that fit one staging buffer."""
        stream = self._streams[dst.device]
        if not op.chunk.raw:  # a torch.save payload: loaded whole on the CPU, uploaded in order
            host = torch.empty(op.sizes, dtype=dst.dtype)
            copy_from_storage(op, files, host)
            with torch.cuda.stream(stream):
                dst.copy_(host)
            return
        for piece in split_op(op, self.buffer_bytes):
            slot = self._free.get()
            try:
                if slot.uploaded is not None:
                    slot.uploaded.synchronize()
                if slot.buffer is None:
                    slot.buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=True)
                host = slot.buffer[: piece.nbytes].view(dst.dtype).view(piece.sizes)
                copy_from_storage(piece, files, host)
                with torch.cuda.stream(stream):
                    dst[_region([p - o for p, o in zip(piece.dst_start, op.dst_start)], piece.sizes)].copy_(
                        host, non_blocking=True)
                    slot.uploaded = torch.cuda.Event()
                    slot.uploaded.record(stream)
            finally:
                self._free.put(slot)

    def finish(self) -> None:
        """Wait for every upload (the pinned buffers are then free to go)."""
        for stream in self._streams.values():
            stream.synchronize()
