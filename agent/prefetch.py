"""Warms the page cache with a node's share of a snapshot while its workers start.

The share is what the node's ranks will read: their per-rank entries (a rank new to the job takes
rank 0's), the replicated tensors, and of each sharded tensor stored in slabs of rows the rows its
ranks own under an even split of dimension 0 (FSDP2's ``Shard(0)``), of any other every chunk. The
memory tier's fetch pulls the files this names; a target laid out otherwise than the rows guessed
(a ``Shard(1)`` restored from a snapshot written as ``Shard(0)``) can lack a file, and its restore
then falls back to storage.
Reading goes through one small buffer per thread, so the agent's memory stays bounded whatever
the snapshot's size; the kernel's page cache holds the result.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torchsnapshot.manifest import DTensorEntry, ObjectEntry, ShardedTensorEntry
from torchsnapshot.manifest_utils import is_fully_replicated_entry

from agent.errors import RestoreError
from agent.restore.manifest import (
    TENSOR_ENTRY_TYPES,
    StoredChunk,
    StoredTensor,
    load_metadata,
    manifest_for_rank,
    stored_tensor,
)

BUFFER_BYTES = 8 << 20
ByteRange = tuple[str, int, int]
"""(file relative to the snapshot, start, end exclusive)"""


def node_share(snapshot: Path, ranks: Iterable[int], world_size: int) -> list[ByteRange]:
    """The byte ranges of ``snapshot`` that ``ranks`` (of ``world_size``) will read, merged."""
    return _merged(_wanted(snapshot, ranks, world_size), snapshot)


def files_read(snapshot: Path, ranks: Iterable[int], world_size: int) -> set[str]:
    """The files of ``snapshot`` (relative) that ``ranks`` (of ``world_size``) will read; only the
    snapshot's metadata needs to be there."""
    return {name for name, _, _ in _wanted(snapshot, ranks, world_size)}


def _wanted(snapshot: Path, ranks: Iterable[int], world_size: int) -> list[ByteRange]:
    metadata = load_metadata(snapshot)
    wanted: list[ByteRange] = []
    for rank in ranks:
        for entry in manifest_for_rank(metadata, rank).values():
            if isinstance(entry, ObjectEntry):
                wanted.append((entry.location, 0, -1))
            elif isinstance(entry, TENSOR_ENTRY_TYPES):
                try:
                    stored = stored_tensor(entry)
                except RestoreError:
                    continue  # no shard stored: nothing to read
                sharded = isinstance(entry, (DTensorEntry, ShardedTensorEntry)) and not is_fully_replicated_entry(entry)
                rows = _even_rows(stored.shape, rank, world_size) if sharded and _row_slabs(stored) else None
                wanted.extend(_chunk_range(chunk, rows) for chunk in stored.chunks)
    return [r for r in wanted if r is not None]


def prefetch(snapshot: Path, ranges: list[ByteRange], *, threads: int = 4,
             stop: threading.Event | None = None) -> int:
    """Read ``ranges`` once (into the page cache); returns the bytes read. Stops early when
    ``stop`` is set (the round it was for is over)."""
    pieces = [(name, lo, min(lo + BUFFER_BYTES, hi)) for name, start, hi in ranges
              for lo in range(start, hi, BUFFER_BYTES)]
    local = threading.local()

    def read(piece: ByteRange) -> int:
        if stop is not None and stop.is_set():
            return 0
        name, lo, hi = piece
        buffer = getattr(local, "buffer", None) or bytearray(BUFFER_BYTES)
        local.buffer = buffer
        fd = os.open(snapshot / name, os.O_RDONLY)
        try:
            return os.preadv(fd, [memoryview(buffer)[: hi - lo]], lo)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="torchrevive-prefetch") as pool:
        return sum(pool.map(read, pieces))


def _row_slabs(stored: StoredTensor) -> bool:
    """Whether every chunk spans the whole tensor but in dimension 0."""
    return all(c.offsets[1:] == (0,) * (len(c.offsets) - 1) and c.sizes[1:] == stored.shape[1:] for c in stored.chunks)


def _even_rows(shape: tuple[int, ...], rank: int, world_size: int) -> tuple[int, int] | None:
    if not shape or rank >= world_size:
        return None
    per = math.ceil(shape[0] / world_size)
    return min(shape[0], rank * per), min(shape[0], (rank + 1) * per)


def _chunk_range(chunk: StoredChunk, rows: tuple[int, int] | None) -> ByteRange | None:
    if chunk.byte_length < 0 or not chunk.raw or rows is None or not chunk.sizes:
        end = chunk.byte_offset + chunk.byte_length if chunk.byte_length >= 0 else -1
        return chunk.location, chunk.byte_offset, end
    lo, hi = max(rows[0], chunk.offsets[0]), min(rows[1], chunk.offsets[0] + chunk.sizes[0])
    if hi <= lo:
        return None
    row_bytes = math.prod(chunk.sizes[1:]) * chunk.dtype.itemsize
    start = chunk.byte_offset + (lo - chunk.offsets[0]) * row_bytes
    return chunk.location, start, start + (hi - lo) * row_bytes


def _merged(ranges: list[ByteRange], snapshot: Path) -> list[ByteRange]:
    """Whole-file ranges resolved to the file's size, overlapping ranges of a file joined."""
    resolved = sorted((name, lo, hi if hi >= 0 else (snapshot / name).stat().st_size) for name, lo, hi in ranges)
    merged: list[ByteRange] = []
    for name, lo, hi in resolved:
        if merged and merged[-1][0] == name and lo <= merged[-1][2]:
            merged[-1] = (name, merged[-1][1], max(hi, merged[-1][2]))
        else:
            merged.append((name, lo, hi))
    return merged
