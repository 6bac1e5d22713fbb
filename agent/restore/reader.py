"""Executes a read plan with a thread pool, straight into the destination tensors; CUDA
destinations are read into a bounded set of pinned host buffers and copied to the device
asynchronously on a side stream.

A copy whose bytes are contiguous both in the file and in the destination (the common case: whole
tensors and row blocks, in pieces of a few MiB) is one positional read (``preadv``, which
releases the GIL) into the destination's memory: no intermediate copy, no mapping, and a file
truncated or failing while it is read gives a short read or an error, never SIGBUS. A strided
copy (a block of columns) goes through a read-only shared mapping instead, with a strided view
that touches only the pages of its rows: measured side by side, about 1.5x less CPU warm and
1.5-2x faster cold than gathering the rows with ``preadv``. The file's size is checked just
before such a copy; a file truncated during the copy itself (a few milliseconds) still faults.
No mapping is writable: nothing is charged against the commit limit (``vm.overcommit_memory=2``).

Every copy checks that the bytes it writes are exactly its destination region's (a stored chunk's
dtype and box are checked against its tensor's when the metadata is loaded; this is the last line
of defence against writing past a tensor). Descriptors are kept open across copies, one per thread
and file (the kernel's readahead is per open file), but never more than a share of the process's
RLIMIT_NOFILE: the least recently used ones not in use are closed first.
"""

from __future__ import annotations

import ctypes
import functools
import io
import itertools
import math
import mmap
import os
import queue
import resource
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch

from agent.errors import RestoreError
from agent.restore.plan import CopyOp, split_op

DEFAULT_PINNED_MB = 256
"""Pinned host memory a rank may use to stage CUDA destinations, unless told otherwise."""
MAX_STAGING_BYTES = 16 << 20
"""The largest pinned staging buffer: a few MiB already keep a host-to-device link busy."""

# SnapshotFiles.mapping is read-only (no commit charge); torch.frombuffer warns about that once,
# for the DCP reader's views of it, which are only ever read.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=r"agent\.restore\.")


class StorageReadError(RestoreError):
    """A snapshot file could not be opened, ended early, failed while being read, or held bytes
    that are not what its metadata says. ``target`` is the destination being filled, when known."""

    def __init__(self, location: str, message: str) -> None:
        super().__init__(message)
        self.location = location
        self.target: int | None = None


def default_io_threads() -> int:
    """One reader per core, at least 2, at most 32: copies out of the page cache are CPU-bound,
    and more threads than cores only contend (measured side by side on 2 cores: 2 threads take
    7% less CPU than 4 warm, and read as fast cold)."""
    return min(32, max(2, os.cpu_count() or 1))


def descriptor_budget() -> int:
    """Descriptors one SnapshotFiles keeps open between uses: a quarter of the soft RLIMIT_NOFILE
    (the rest is the training process's: sockets, NCCL, data loaders), at least 8."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(8, (soft if soft != resource.RLIM_INFINITY else 1 << 16) // 4)


_Handle = tuple[str, int, str]
"""("fd", thread id, file) for a thread's descriptor, ("map", 0, file) for a file's mapping."""


class SnapshotFiles:
    """The snapshot's files, opened read-only and lazily (once per reading thread).

    Descriptors and mappings (each mapping holds a descriptor of its own) stay open for the next
    copy, at most ``max_open`` of them (default :func:`descriptor_budget`) while not in use: a
    snapshot of thousands of files read by 32 threads must not run out of descriptors.
    """

    def __init__(self, root: Path, *, max_open: int | None = None) -> None:
        self._root = root
        self._max_open = max_open or descriptor_budget()
        self._open: OrderedDict[_Handle, Any] = OrderedDict()  # least recently used first
        self._in_use: dict[_Handle, int] = {}
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

    @contextmanager
    def _using(self, handle: _Handle, make: Callable[[], Any]) -> Iterator[Any]:
        """The open descriptor or mapping ``handle`` (made by ``make`` when not open), kept open
        while the block runs; on the way out, the least recently used ones not in use are closed
        down to the budget (one in use is never closed: a thread is reading through it)."""
        with self._lock:
            if handle not in self._open:
                self._open[handle] = make()
            self._open.move_to_end(handle)
            self._in_use[handle] = self._in_use.get(handle, 0) + 1
            opened = self._open[handle]
        try:
            yield opened
        finally:
            with self._lock:
                self._in_use[handle] -= 1
                if not self._in_use[handle]:
                    del self._in_use[handle]
                excess = len(self._open) - self._max_open
                if excess > 0:
                    idle = (h for h in self._open if h not in self._in_use)
                    for victim in list(itertools.islice(idle, excess)):
                        _close(self._open.pop(victim))

    def _descriptor(self, location: str) -> AbstractContextManager[int]:
        """This thread's read-only descriptor of the file (one per thread: the kernel keeps its
        readahead state per open file, and threads reading apart would confuse a shared one);
        StorageReadError naming the file when it cannot be opened."""

        def open_file() -> int:
            try:
                return os.open(self.path(location), os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise StorageReadError(location, f"{self.path(location)}: cannot be opened ({exc.strerror}) "
                                       "while being restored") from None

        return self._using(("fd", threading.get_ident(), location), open_file)

    def read_into(self, location: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the file's bytes from ``offset`` on; StorageReadError naming the
        file and the bytes when it ends early (truncated) or the read fails."""
        with self._descriptor(location) as fd:
            done = 0
            try:
                while done < len(buffer):
                    got = os.preadv(fd, [buffer[done:]], offset + done)
                    if got == 0:
                        raise StorageReadError(location, f"{self.path(location)}: ends at byte {offset + done}, "
                                               f"before bytes {offset}..{offset + len(buffer)} could be read "
                                               "(truncated while being restored)")
                    done += got
            except OSError as exc:
                raise StorageReadError(location, f"{self.path(location)}: reading bytes {offset}.."
                                       f"{offset + len(buffer)} failed ({exc.strerror or exc})") from exc

    def read(self, location: str, offset: int, length: int) -> bytearray:
        """``length`` bytes of the file from ``offset`` on (see :meth:`read_into`)."""
        payload = bytearray(length)
        self.read_into(location, offset, memoryview(payload))
        return payload

    @contextmanager
    def mapped(self, location: str, end: int) -> Iterator[mmap.mmap]:
        """A read-only shared mapping of the whole file (no commit charge), made once and kept
        open while the block runs, once the file's first ``end`` bytes are checked to be there now
        (a mapping touched past the end of its file raises SIGBUS); StorageReadError naming the
        file if not."""
        with self._descriptor(location) as fd:
            size = os.fstat(fd).st_size
            if size < end or not size:  # (an empty file cannot be mapped)
                raise StorageReadError(location, f"{self.path(location)}: {size} bytes, {end} needed (truncated "
                                       "while being restored)")
            with self._using(("map", 0, location), lambda: mmap.mmap(fd, 0, prot=mmap.PROT_READ)) as mapping:
                if len(mapping) < end:  # mapped before the file grew to its size now
                    raise StorageReadError(location, f"{self.path(location)}: mapped at {len(mapping)} bytes, {end} "
                                           "needed (changed while being restored)")
                yield mapping

    def close(self) -> None:
        with self._lock:
            for opened in self._open.values():
                _close(opened)
            self._open.clear()


def _close(opened: int | mmap.mmap) -> None:
    if not isinstance(opened, mmap.mmap):
        os.close(opened)
        return
    try:
        opened.close()
    except BufferError:  # a view of it outlives a failed copy (in a traceback): it closes when the view goes
        pass


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
        try:
            if dst.is_cuda:
                assert staging is not None
                staging.upload(op, dst, files)
            else:
                copy_from_storage(op, files, dst)
        except StorageReadError as exc:
            exc.target = op.target
            raise
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
        whole = _loaded_chunk(op, files)
        dst.copy_(whole[_region(op.src_start, op.sizes)])
        return
    if dst.dtype != chunk.dtype or tuple(dst.shape) != op.sizes:  # checked with the metadata: never for real
        raise StorageReadError(chunk.location, f"{files.path(chunk.location)}: a chunk of {chunk.dtype} copied as "
                               f"{list(op.sizes)} into {dst.dtype} {list(dst.shape)}; the snapshot is damaged or "
                               "crafted: restore another one")
    start, end = byte_span(op)
    if end - start == op.nbytes and dst.is_contiguous():
        files.read_into(chunk.location, start, _memory_of(dst))
    else:
        _copy_mapped(op, files, dst, start, end)


def _loaded_chunk(op: CopyOp, files: SnapshotFiles) -> torch.Tensor:
    """A torch.save chunk, loaded as data; StorageReadError unless it is a tensor of exactly the
    chunk's sizes and dtype."""
    chunk = op.chunk
    where = f"{files.path(chunk.location)}: bytes {chunk.byte_offset}..{chunk.byte_offset + chunk.byte_length}"
    payload = files.read(chunk.location, chunk.byte_offset, chunk.byte_length)
    try:
        whole = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as exc:  # torch.load raises whatever a damaged archive or a refused pickle makes it hit
        raise StorageReadError(chunk.location, f"{where} are not a tensor saved by torch.save ({exc}); the "
                               "snapshot is damaged or crafted: restore another one") from None
    if not isinstance(whole, torch.Tensor) or whole.dtype != chunk.dtype or tuple(whole.shape) != chunk.sizes:
        found = f"a {whole.dtype} tensor of shape {list(whole.shape)}" if isinstance(whole, torch.Tensor) else \
            f"a {type(whole).__name__}"
        raise StorageReadError(chunk.location, f"{where} hold {found} where the metadata says a {chunk.dtype} "
                               f"tensor of shape {list(chunk.sizes)}; the snapshot is damaged or crafted: restore "
                               "another one")
    return whole


def _copy_mapped(op: CopyOp, files: SnapshotFiles, dst: torch.Tensor, start: int, end: int) -> None:
    """A strided copy, through a strided view of the file's read-only mapping."""
    with files.mapped(op.chunk.location, end) as mapping:
        src = _view(mapping, start, end).view(op.chunk.dtype)
        dst.copy_(src.as_strided(op.sizes, _row_major_strides(op.chunk.sizes)))
        del src
        release_pages(mapping, start, end)


def _view(mapping: mmap.mmap, start: int, end: int) -> torch.Tensor:
    """Bytes ``start``..``end`` of a read-only mapping as a uint8 tensor, only ever read (and
    valid while the mapping is open). torch.frombuffer on the mapping itself would warn that it
    is not writable; numpy gives its address."""
    address = numpy.frombuffer(mapping, dtype=numpy.uint8, count=end - start, offset=start).ctypes.data
    return torch.frombuffer((ctypes.c_char * (end - start)).from_address(address), dtype=torch.uint8)


def _memory_of(tensor: torch.Tensor) -> memoryview:
    """A dense CPU tensor's memory, writable: exactly its bytes, so that nothing written through
    it lands past the tensor."""
    assert tensor.is_contiguous()
    return memoryview((ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())).cast("B")


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
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
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
