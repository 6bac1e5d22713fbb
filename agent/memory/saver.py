"""Memory snapshots, the worker's side: every ``interval_steps`` each rank stages its state (the
same staged copy as a storage save, in buffers of its own), writes it in torchsnapshot's format
into its node's memory directory (tmpfs), and pushes the files it wrote to its node's buddy agent.
Rank 0 commits once every rank's files are on two nodes: the checksum record and the marker go to
the buddy first, then into its own copy.

All of it runs in the background on a gloo group of its own. A save still in flight when the next
is due is skipped (every rank decides together). A failure (tmpfs full, the buddy gone) is a
warning and a ``memory_save_failed`` event, never an exception, and the node frees what it held of
that snapshot: the storage tier goes on as if the memory tier were off, and the next save has the
room.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

from agent.checkpoint.checksums import CHECKSUMS_FILE, FileDigest, write_checksums
from agent.checkpoint.collectives import first_error, own_group, rank
from agent.checkpoint.commit import agree_and_commit
from agent.checkpoint.dirs import COMMIT_MARKER
from agent.checkpoint.stage import Stager
from agent.checkpoint.write import write_snapshot
from agent.commit_notice import write_notice
from agent.events import EventLog
from agent.memory.layout import KEY_FILE, MemorySnapshot, discard, prune
from agent.memory.peer_files import PeerError, PeerFileClient, parse_address, read_key


class MemorySaver:
    """Writes memory snapshots of this rank's state (see the module doc).

    Args:
        root: this node's memory directory.
        interval_steps: a memory snapshot every this many steps.
        buddy: ``host:port`` of the buddy node's agent ("" when the job has one node: then nothing
            is committed, as a snapshot must be in RAM on two nodes).
        round: this round's number (a buddy of another round refuses the files).
        local_rank: the node's local rank 0 prunes the node's older snapshots.
        events: where ``memory_save_committed`` / ``memory_save_failed`` go.
        commit_notice: where to tell the node's agent of each commit (:mod:`agent.commit_notice`).
    """

    def __init__(self, root: Path, *, interval_steps: int, buddy: str, round: int, local_rank: int,
                 events: EventLog, commit_notice: str | None = None) -> None:
        self.root, self.interval_steps, self.round = Path(root), interval_steps, round
        self._buddy = parse_address(buddy) if buddy else None
        self._secret = read_key(self.root / KEY_FILE) if buddy else b""
        self._local_rank, self.events, self._commit_notice = local_rank, events, commit_notice
        self._stager = Stager()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrevive-memory")
        self._group: dist.ProcessGroup | None = None
        self._in_flight: Future[None] | None = None
        self._warned: set[str] = set()
        self.skipped = 0
        """Saves skipped because the previous one was still being written."""

    def save(self, step: int, state_dicts: Mapping[str, Any], replicated: list[str]) -> bool:
        """Stage ``state_dicts`` and write the memory snapshot of ``step`` in the background;
        False when skipped (the previous one is still in flight on some rank)."""
        busy = self._in_flight is not None and not self._in_flight.done()
        if first_error("busy" if busy else None) is not None:
            self.skipped += 1
            return False
        started = time.perf_counter()
        group = self._save_group()
        staged = self._stager.stage(state_dicts)
        self._in_flight = self._writer.submit(self._write_and_commit, step, staged, replicated, group, started)
        return True

    def wait(self) -> None:
        """Wait for the memory snapshot in flight, if any (its failure is already reported)."""
        if self._in_flight is not None:
            self._in_flight.result()

    def _save_group(self) -> dist.ProcessGroup | None:
        if self._group is None:
            self._group = own_group()
        return self._group

    def _write_and_commit(self, step: int, staged: dict[str, Any], replicated: list[str],
                          group: dist.ProcessGroup | None, started: float) -> None:
        try:
            self._write_and_commit_or_raise(step, staged, replicated, group, started)
        except Exception as exc:  # noqa: BLE001 - a collective failed (a peer died): reported, never raised
            self._failed(MemorySnapshot(self.round, step), f"{type(exc).__name__}: {exc}")

    def _write_and_commit_or_raise(self, step: int, staged: dict[str, Any], replicated: list[str],
                                   group: dist.ProcessGroup | None, started: float) -> None:
        snapshot = MemorySnapshot(self.round, step)
        path = self.root / snapshot.relative
        record = write_snapshot(path, staged, replicated=replicated, group=group)
        committed_bytes = 0

        def on_rank0(files: dict[str, FileDigest], world_size: int) -> str | None:
            nonlocal committed_bytes
            committed_bytes = sum(d.size for d in files.values())
            return self._commit_on_rank0(path, snapshot, files, world_size=world_size)

        error = agree_and_commit(record.error or self._replicate(path, snapshot, record.files), record.files, group,
                                 on_rank0)
        if error is not None:
            self._failed(snapshot, error)
            return
        if self._local_rank == 0:
            prune(self.root, snapshot)
        if self._commit_notice:
            write_notice(self._commit_notice, step=step, tier="memory")
        if rank(group) == 0:
            self.events.record("memory_save_committed", step=step, snapshot=str(path),
                               seconds=time.perf_counter() - started, bytes=committed_bytes)

    def _replicate(self, path: Path, snapshot: MemorySnapshot, files: Mapping[str, FileDigest]) -> str | None:
        """Push this rank's files to the buddy; the error, if any."""
        if self._buddy is None:
            return "the job runs on one node: a memory snapshot needs a buddy node to hold its replica"
        try:
            with PeerFileClient(self._buddy, self._secret, round=self.round) as client:
                for name in sorted(files):
                    client.put(path / name, f"{snapshot.relative}/{name}")
        except (PeerError, OSError) as exc:
            return f"replicating to the buddy node: {exc}"
        return None

    def _commit_on_rank0(self, path: Path, snapshot: MemorySnapshot, files: dict[str, FileDigest], *,
                         world_size: int) -> str | None:
        """The checksum record and the marker: on the buddy first, then here (marker last)."""
        assert self._buddy is not None, "a save without a buddy fails before its commit"
        try:
            write_checksums(path, files)
            marker = path / (COMMIT_MARKER + ".tmp")
            marker.write_text(json.dumps({"step": snapshot.step, "world_size": world_size, "round": snapshot.round,
                                          "committed_at": time.time(), "tier": "memory"}))
            with PeerFileClient(self._buddy, self._secret, round=self.round) as client:
                client.put(path / CHECKSUMS_FILE, f"{snapshot.relative}/{CHECKSUMS_FILE}")
                client.put(marker, f"{snapshot.relative}/{COMMIT_MARKER}")
            os.replace(marker, path / COMMIT_MARKER)
        except (PeerError, OSError) as exc:
            return f"committing {path}: {exc}"
        return None

    def _failed(self, snapshot: MemorySnapshot, error: str) -> None:
        """Report a save that was not committed, and free what the node holds of it."""
        if self._local_rank == 0:
            discard(self.root, snapshot)
        if rank(self._group) == 0:
            self.events.record("memory_save_failed", step=snapshot.step, error=error)
        if error not in self._warned:  # once per distinct cause: saves may run every step
            self._warned.add(error)
            warnings.warn(f"memory snapshot of step {snapshot.step} not committed ({error}); the storage tier is "
                          "unaffected", stacklevel=2)
