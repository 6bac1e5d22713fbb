"""Write: torchsnapshot writes the (staged) state through a storage plugin of ours that makes
each file durable and checksums it from the bytes in memory as it writes them.

The plugin is registered under the ``torchrevive`` protocol (torchsnapshot's ``storage_plugins``
entry point), so torchsnapshot itself decides what goes where and the format stays its own. Each
rank learns from its own writes exactly which files it wrote, their sizes and block digests: the
commit never lists the directory, re-reads a file, or touches another rank's files.

A failed write (a full disk, say) is recorded, not raised: the rank goes on through
torchsnapshot's collectives with the others, and the commit, where every rank's outcome is
gathered, fails the save on every rank at once instead of leaving the others in a barrier.

The threads that write (and hash) run at a lower CPU priority (a niceness, 10 by default, or
Linux's ``SCHED_IDLE`` policy; a thread's own on Linux), and there are few of them
(:func:`limit_write_threads`; torchsnapshot's default is 16 per rank), so that a background save
takes the CPU time training leaves, not training's: on a machine whose cores training uses, it is
the save that waits. Niceness alone is not enough: the kernel shares the CPU by the sum of the
threads' weights, and 16 writers at niceness 10 still weigh almost as much as two training threads.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torchsnapshot
from torchsnapshot.io_types import ReadIO, StoragePlugin, WriteIO
from torchsnapshot.storage_plugins.fs import FSStoragePlugin

from agent.checkpoint.checksums import FileDigest, digest_buffer
from agent.checkpoint.direct_write import write_durably
from agent.checkpoint.durable import fsync_dir
from agent.checkpoint.writer_priority import WriterPriority, lower_thread_priority
from agent.restore.manifest import METADATA_FILE

PROTOCOL = "torchrevive"
IO_CONCURRENCY_ENV = "TORCHSNAPSHOT_MAX_PER_RANK_IO_CONCURRENCY_OVERRIDE"
"""torchsnapshot's knob: how many writes (and reads) a rank has in flight at once."""
SLAB_THRESHOLD_ENV = "TORCHSNAPSHOT_SLAB_SIZE_THRESHOLD_BYTES_OVERRIDE"
"""torchsnapshot's knob: tensors smaller than this are copied into shared files ("slabs") of about
this size (its default: 128 MB)."""
SLAB_THRESHOLD_BYTES = 4 << 20
"""Ours: only small tensors are batched. torchsnapshot builds each slab with a copy in its event
loop, holding the GIL: at its default, a second copy of nearly every tensor of a model whose
tensors are under 128 MB, before the first write, while training waits for the GIL (the writes of
a 2 GB state began 2 s after the call, against 0.2 s, and were durable 3.3x later; see
docs/measurements.md)."""
_RECORD_OPTION = "torchrevive_record"
_PRIORITY_OPTION = "torchrevive_priority"
_DIRECT_OPTION = "torchrevive_direct"


def limit_write_threads(threads: int) -> None:
    """At most ``threads`` snapshot writes in flight per rank, for every snapshot this process
    takes (torchsnapshot reads it from the environment), unless the environment sets it already."""
    os.environ.setdefault(IO_CONCURRENCY_ENV, str(threads))


@dataclass
class WriteRecord:
    """What one rank wrote: relative path -> digest, the first error, if any, the snapshot's
    metadata when this rank wrote it (rank 0), as written, and how many bytes bypassed the page
    cache (see :mod:`agent.checkpoint.direct_write`)."""

    files: dict[str, FileDigest] = field(default_factory=dict)
    error: str | None = None
    metadata: bytes | None = None
    direct_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, relative: str, digest: FileDigest, direct_bytes: int = 0) -> None:
        with self._lock:
            self.files[relative] = digest
            self.direct_bytes += direct_bytes

    def fail(self, message: str) -> None:
        with self._lock:
            self.error = self.error or message


class DurableFSPlugin(StoragePlugin):
    """torchsnapshot's file-system plugin, but each file is fsync'ed, its directory too, and its
    block digests recorded; errors go to the record (see the module doc). With the ``direct``
    option, files bypass the page cache where the file system allows it."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        options = storage_options or {}
        self.root = root
        self.record: WriteRecord = options.get(_RECORD_OPTION) or WriteRecord()
        self.priority: WriterPriority = options.get(_PRIORITY_OPTION, 0)
        self.direct: bool = options.get(_DIRECT_OPTION, False)
        self._reader = FSStoragePlugin(root)
        self._dirs_made: set[str] = set()

    async def write(self, write_io: WriteIO) -> None:
        if self.record.error is not None:
            return  # this save has failed already: write nothing more
        try:
            await asyncio.to_thread(self._write_durably, write_io.path, write_io.buf)
        except OSError as exc:
            self.record.fail(f"writing {os.path.join(self.root, write_io.path)}: {exc}")

    def _write_durably(self, relative: str, buf: Any) -> None:
        lower_thread_priority(self.priority)
        path = os.path.join(self.root, relative)
        directory = os.path.dirname(path)
        if directory not in self._dirs_made:
            os.makedirs(directory, exist_ok=True)
            self._dirs_made.add(directory)
        view = memoryview(buf).cast("B")
        if relative == METADATA_FILE:
            self.record.metadata = bytes(view)  # small; the commit checks it without reading it back
        digest = digest_buffer(view)
        direct_bytes = write_durably(path, view, direct=self.direct)
        self.record.add(relative, digest, direct_bytes)

    async def read(self, read_io: ReadIO) -> None:
        await self._reader.read(read_io)

    async def delete(self, path: str) -> None:
        await self._reader.delete(path)

    async def delete_dir(self, path: str) -> None:
        await self._reader.delete_dir(path)

    async def close(self) -> None:
        """Make the directories durable: each one's entries for the new files and directories,
        from the deepest up to the snapshot's own."""
        root = Path(self.root)
        directories: set[Path] = set()
        for made in map(Path, self._dirs_made):
            directories.update(p for p in (made, *made.parents) if p.is_relative_to(root))
        for directory in sorted(directories, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(directory)


def storage_plugin(path: str, storage_options: dict[str, Any] | None = None) -> DurableFSPlugin:
    """The ``storage_plugins`` entry point: torchsnapshot calls it for ``torchrevive://`` paths."""
    return DurableFSPlugin(path, storage_options)


def write_snapshot(path: Path, app_state: dict[str, Any], *, replicated: list[str],
                   group: dist.ProcessGroup | None, priority: WriterPriority = 0,
                   direct: bool = False) -> WriteRecord:
    """torchsnapshot writes ``app_state`` into ``path`` over ``group``; what this rank wrote. The
    file writes run at ``priority``, and bypass the page cache when ``direct`` (where the file
    system allows it); only tensors under :data:`SLAB_THRESHOLD_BYTES` are batched into shared files
    (unless the environment sets torchsnapshot's threshold).

    Every rank of ``group`` calls this together. Errors in the files are in the record; anything
    else torchsnapshot raises is recorded too, so that the commit's collective still runs."""
    record = WriteRecord()
    os.environ.setdefault(SLAB_THRESHOLD_ENV, str(SLAB_THRESHOLD_BYTES))  # read by torchsnapshot at each take
    try:
        torchsnapshot.Snapshot.take(f"{PROTOCOL}://{path}", app_state, pg=group, replicated=replicated,
                                    storage_options={_RECORD_OPTION: record, _PRIORITY_OPTION: priority,
                                                     _DIRECT_OPTION: direct})
    except Exception as exc:  # noqa: BLE001 - reported on every rank by the commit
        record.fail(f"torchsnapshot failed writing {path}: {type(exc).__name__}: {exc}")
    return record
