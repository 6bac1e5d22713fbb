"""Memory snapshots, the worker's side: every ``interval_steps`` each rank stages its state (the
same staged copy as a storage save, in buffers of its own), writes it in torchsnapshot's format
into its node's memory directory (tmpfs), and pushes the files it wrote to its node's buddy agent.
Rank 0 commits once every rank's files are on two nodes: the checksum record and the marker go to
the buddy first, then into its own copy.

All of it runs in the background on a gloo group of its own. A save still in flight when the next
is due is skipped (every rank decides together). A failure (tmpfs full, the buddy gone) is a
warning and a ``memory_save_failed`` event, never an exception, and the node frees what it held of
that snapshot: the storage tier goes on as if the memory tier were off, and the next save has the
room. A committed snapshot is never freed: a failure after the commit point (the commit notice,
pruning, the event) is a warning, and a rank that never learns the commit's verdict keeps its files.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

from agent.checkpoint.checksums import CHECKSUMS_FILE, FileDigest, write_checksums
from agent.checkpoint.collectives import first_error, own_group, rank
from agent.checkpoint.commit import agree_and_commit, metadata_refused
from agent.checkpoint.dirs import COMMIT_MARKER
from agent.checkpoint.stage import Stager
from agent.checkpoint.write import write_snapshot
from agent.checkpoint.writer_priority import WriterPriority, lower_thread_priority
from agent.commit_notice import write_notice
from agent.events import EventLog
from agent.memory.layout import KEY_FILE, MemorySnapshot, discard, prune
from agent.memory.peer_files import PeerError, PeerFileClient, parse_address, read_key
from agent.memory.run_dir import read_run


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
        writer_nice: how low its writer threads run (see :data:`~agent.checkpoint.writer_priority.WriterPriority`).
    """

    def __init__(self, root: Path, *, interval_steps: int, buddy: str, round: int, local_rank: int,
                 events: EventLog, commit_notice: str | None = None, writer_nice: WriterPriority = 10) -> None:
        self.root, self.interval_steps, self.round = Path(root), interval_steps, round
        self._buddy = parse_address(buddy) if buddy else None
        self._secret = read_key(self.root / KEY_FILE) if buddy else b""
        self.run = read_run(self.root) if buddy else ""
        """The rendezvous run this node's agent serves: each commit marker names it."""
        self._local_rank, self.events, self._commit_notice = local_rank, events, commit_notice
        self._stager = Stager()
        self.writer_nice = writer_nice
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrevive-memory",
                                          initializer=lower_thread_priority, initargs=(writer_nice,))
        self._group: dist.ProcessGroup | None = None
        self._in_flight: Future[None] | None = None
        self._warned: set[str] = set()
        self.skipped = 0
        """Saves skipped because the previous one was still being written."""

    def save(self, step: int, state_dicts: Mapping[str, Any], replicated: list[str], *,
             step_s: float | None = None) -> bool:
        """Stage ``state_dicts`` and write the memory snapshot of ``step`` in the background;
        False when skipped (the previous one is still in flight on some rank). ``step_s``: the
        job's steady step time, for the commit notice."""
        busy = self._in_flight is not None and not self._in_flight.done()
        if first_error("busy" if busy else None) is not None:
            self.skipped += 1
            return False
        started = time.perf_counter()
        group = self._save_group()
        staged = self._stager.stage(state_dicts)
        self._in_flight = self._writer.submit(self._write_and_commit, step, staged, replicated, group, started,
                                             step_s)
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
                          group: dist.ProcessGroup | None, started: float, step_s: float | None) -> None:
        """Write, replicate and commit; report the outcome. Only a snapshot known not to be
        committed is freed: what happens after the commit point never undoes it."""
        snapshot = MemorySnapshot(self.round, step)
        path = self.root / snapshot.relative
        try:
            record = write_snapshot(path, staged, replicated=replicated, group=group, priority=self.writer_nice)
            error = record.error or self._replicate(path, snapshot, record.files)
        except Exception as exc:  # noqa: BLE001 - a collective failed (a peer died): reported, never raised
            self._failed(snapshot, f"{type(exc).__name__}: {exc}")  # this rank never reached the commit
            return
        committed: list[int] = []
        """Rank 0: the bytes committed, once its commit is durable."""

        def on_rank0(files: dict[str, FileDigest], world_size: int) -> str | None:
            error = metadata_refused(path, record.metadata) or self._commit_on_rank0(path, snapshot, files,
                                                                                      world_size=world_size)
            if error is None:
                committed.append(sum(d.size for d in files.values()))
            return error

        try:
            error = agree_and_commit(error, record.files, group, on_rank0)
        except Exception as exc:  # noqa: BLE001 - the verdict never came (a peer died meanwhile)
            if not committed:  # rank 0 knows it did not commit; any other rank cannot know: it keeps its files
                self._failed(snapshot, f"{type(exc).__name__}: {exc}", outcome_known=rank(group) == 0)
                return
        if error is not None:
            self._failed(snapshot, error)
            return
        self._after_commit(snapshot, path, committed[0] if committed else 0, started, group, step_s)

    def _after_commit(self, snapshot: MemorySnapshot, path: Path, committed_bytes: int, started: float,
                      group: dist.ProcessGroup | None, step_s: float | None) -> None:
        """The bookkeeping of a committed snapshot; each step that fails is a warning, and the
        snapshot stays committed."""
        steps: list[tuple[str, Callable[[], object]]] = []
        if self._local_rank == 0:
            steps.append(("pruning the older snapshots", lambda: prune(self.root, snapshot)))
        if self._commit_notice:
            notice = self._commit_notice
            steps.append(("writing the commit notice", lambda: write_notice(notice, step=snapshot.step, tier="memory",
                                                                            step_s=step_s)))
        if rank(group) == 0:
            steps.append(("recording the commit", lambda: self.events.record(
                "memory_save_committed", step=snapshot.step, snapshot=str(path),
                seconds=time.perf_counter() - started, bytes=committed_bytes)))
        for what, run in steps:
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - the snapshot is committed: nothing after the commit may undo it
                cause = f"{what} failed ({type(exc).__name__}: {exc})"
                self._warn_once(cause, f"memory snapshot of step {snapshot.step} committed, but {cause}; the "
                                       "snapshot stays")

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
                                          "committed_at": time.time(), "tier": "memory", "run": self.run}))
            with PeerFileClient(self._buddy, self._secret, round=self.round) as client:
                client.put(path / CHECKSUMS_FILE, f"{snapshot.relative}/{CHECKSUMS_FILE}")
                client.put(marker, f"{snapshot.relative}/{COMMIT_MARKER}")
            os.replace(marker, path / COMMIT_MARKER)
        except (PeerError, OSError) as exc:
            return f"committing {path}: {exc}"
        return None

    def _failed(self, snapshot: MemorySnapshot, error: str, *, outcome_known: bool = True) -> None:
        """Report a save that was not committed, and free what the node holds of it; when its
        outcome is not known here (rank 0 may have committed it), keep it: the next commit prunes it."""
        if self._local_rank == 0 and outcome_known:
            discard(self.root, snapshot)
        if rank(self._group) == 0:
            self.events.record("memory_save_failed", step=snapshot.step, error=error)
        kept = "" if outcome_known else "; its commit's outcome is unknown here, so this node keeps its files"
        self._warn_once(error, f"memory snapshot of step {snapshot.step} not committed ({error}){kept}; the storage "
                               "tier is unaffected")

    def _warn_once(self, cause: str, message: str) -> None:
        """Warn once per distinct cause: saves may run every step."""
        if cause not in self._warned:
            self._warned.add(cause)
            warnings.warn(message, stacklevel=3)
