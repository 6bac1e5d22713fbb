"""Checkpointer: snapshots written by torchsnapshot into ``<dir>/step_<N>``, committed atomically,
found again by ``latest()``, pruned by retention, and restored through the restore engine.

A snapshot is *committed* once its marker file exists. The marker is written last, by rank 0,
after every rank has made its files durable (fsync of files and directories) and the block
checksums of every file are recorded. Restore only ever picks committed snapshots, so a crash at
any point of a save leaves the previous one in charge.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torchsnapshot
from torchsnapshot.flatten import flatten
from torchsnapshot.serialization import ALL_SUPPORTED_DTYPES

from agent.checkpoint import compat as snapshot_compat
from agent.checkpoint.checksums import data_files, digest_files, write_checksums
from agent.config import load_config
from agent.errors import RestoreError, TorchreviveError
from agent.events import EventLog
from agent.restore.engine import restore as restore_snapshot
from agent.checkpoint.dirs import (
    COMMIT_MARKER,
    committed_snapshots,
    is_committed,
    list_snapshots,
    snapshot_dir,
    step_of,
)
from agent.worker import WorkerContext


class CheckpointError(TorchreviveError):
    """A save cannot go ahead (say, it would overwrite a committed snapshot)."""


class Checkpointer:
    """Saves and restores an ``app_state`` (name -> object with state_dict/load_state_dict).

    Args:
        dir: the directory holding ``step_<N>`` snapshots (shared by every rank).
        interval_steps: ``maybe_save`` saves when the step is a multiple of this.
        keep: how many committed snapshots retention keeps (>= 1).
        async_save: write in the background (``Snapshot.async_take``); the next save, ``wait``
            or ``restore`` completes and commits it first, so two saves never interleave.
            torchsnapshot-nightly's async_take needs a process group (it fails without one), so
            a process outside any group saves synchronously.
        on_busy: what a save does while the previous async one is still writing: ``"wait"`` for
            it, or ``"skip"`` this save with a warning (all ranks decide together).
        verify: how much of a restored snapshot is checked against its checksums (see
            :func:`agent.restore`).
        restore_options: more keyword arguments for :func:`agent.restore` (io_threads,
            replicated, trust_pickles).
        events: where save and restore events go (default: the log the agent configured).
    """

    def __init__(
        self,
        dir: str | os.PathLike[str],
        *,
        interval_steps: int = 100,
        keep: int = 3,
        async_save: bool = True,
        on_busy: Literal["wait", "skip"] = "wait",
        verify: Literal["off", "sample", "full"] = "sample",
        restore_options: Mapping[str, Any] | None = None,
        events: EventLog | None = None,
    ) -> None:
        if interval_steps < 1 or keep < 1:
            raise ValueError(f"interval_steps ({interval_steps}) and keep ({keep}) must be >= 1")
        if on_busy not in ("wait", "skip") or verify not in ("off", "sample", "full"):
            raise ValueError(f"on_busy must be 'wait' or 'skip' (got {on_busy!r}); verify 'off', 'sample' or "
                             f"'full' (got {verify!r})")
        snapshot_compat.install()
        self.root = Path(dir)
        self.interval_steps = interval_steps
        self.keep = keep
        self.async_save = async_save
        self.on_busy = on_busy
        self.restore_options = {"verify": verify, **(restore_options or {})}
        self.events = events or EventLog.for_worker()
        self._pending: _PendingSave | None = None
        self._restored_from: Path | None = None
        self._first_step_pending = False

    @classmethod
    def from_env(cls) -> Checkpointer:
        """A Checkpointer configured by the job config the agent handed to this rank."""
        ctx = WorkerContext.from_env()
        config = load_config(ctx.config_path)
        directory = ctx.checkpoint_dir or config.checkpoint.dir
        if not directory:
            raise CheckpointError("no checkpoint directory: set checkpoint.dir in the job config "
                                  "(or --set checkpoint.dir=PATH)")
        return cls(
            directory,
            interval_steps=config.checkpoint.interval_steps,
            keep=config.checkpoint.keep,
            async_save=config.checkpoint.async_save,
            on_busy=config.checkpoint.on_busy,
            verify=config.checkpoint.verify,
            restore_options={"io_threads": config.restore.io_threads, "replicated": config.restore.replicated,
                             "trust_pickles": config.restore.trust_pickles, "pinned_mb": config.restore.pinned_mb},
            events=EventLog.for_worker(ctx),
        )

    def latest(self) -> Path | None:
        """The newest committed snapshot, or None."""
        committed = committed_snapshots(self.root)
        return committed[-1][1] if committed else None

    def save(self, step: int, app_state: Mapping[str, Any]) -> bool:
        """Write ``app_state`` as ``step_<step>`` (every rank calls this with the same step).

        Returns False when the save was skipped (``on_busy="skip"`` and the previous one is still
        writing). A failed write (say, a full disk) removes the partial snapshot and raises
        CheckpointError on every rank; the previous committed snapshot stays the latest.
        """
        if self._pending is not None and self.on_busy == "skip" and _first_error(
                None if self._pending.handle.done() else "busy") is not None:
            warnings.warn(f"skipping the save of step {step}: step {self._pending.step} is still being written",
                          stacklevel=2)
            self.events.record("save_skipped", step=step, busy_with=self._pending.step)
            return False
        self.wait()
        path = snapshot_dir(self.root, step)
        if is_committed(path):
            raise CheckpointError(f"{path}: a committed snapshot of step {step} exists; it is never overwritten")
        _check_dtypes(path, app_state)
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if path.exists():  # an uncommitted leftover of a crashed save of this same step
                shutil.rmtree(path)
        _barrier()
        started = time.perf_counter()
        error = None
        try:
            if self.async_save and dist.is_initialized():
                handle = torchsnapshot.Snapshot.async_take(str(path), dict(app_state))
                self._pending = _PendingSave(step, path, handle, started)
                self.events.record("save_started", step=step, blocking_s=time.perf_counter() - started)
                return True
            torchsnapshot.Snapshot.take(str(path), dict(app_state))
        except OSError as exc:
            error = exc
        self._finish(step, path, started, error)
        return True

    def maybe_save(self, step: int, app_state: Mapping[str, Any]) -> bool:
        """Save when ``step`` is a multiple of ``interval_steps``; True when it did. The first call
        after ``restore`` (whether or not a snapshot existed) records the ``first_step_done``
        event: training is back."""
        if self._first_step_pending:
            self._first_step_pending = False
            self.events.record("first_step_done", step=step,
                               restored_from=str(self._restored_from) if self._restored_from else None)
        if step % self.interval_steps:
            return False
        return self.save(step, app_state)

    def wait(self) -> None:
        """Complete and commit the save in flight, if any."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        error = None
        try:
            pending.handle.wait()
        except OSError as exc:
            error = exc
        self._finish(pending.step, pending.path, pending.started, error)

    def restore(self, app_state: Mapping[str, Any]) -> int | None:
        """Restore the snapshot the agent chose for this round (TORCHREVIVE_RESTORE_FROM), else the
        latest committed one, and return its step (None when there is no snapshot yet).

        A snapshot that fails to restore on any rank (damaged, checksum mismatch) gives way to the
        previous committed one, with a warning and a ``restore_fallback`` event; all ranks move on
        together. When none restores, RestoreError.
        """
        self.wait()
        self._first_step_pending = True
        chosen = WorkerContext.from_env().restore_from
        candidates = [p for _, p in reversed(committed_snapshots(self.root))]
        if chosen:
            candidates = [Path(chosen)] + [p for p in candidates if p != Path(chosen)]
        error = None
        for path in candidates:
            stats = None
            try:
                stats = restore_snapshot(path, app_state, **self.restore_options)
            except RestoreError as exc:
                error = str(exc)
            error = _first_error(None if stats else error)
            if stats is not None and error is None:
                self._restored_from = path
                self.events.record("restore_done", snapshot=str(path), step=step_of(path), bytes=stats.bytes_read,
                                   seconds=stats.seconds, gbps=stats.gbps, bytes_verified=stats.bytes_verified)
                return step_of(path)
            warnings.warn(f"falling back from {path}: {error}", stacklevel=2)
            self.events.record("restore_fallback", snapshot=str(path), error=error)
        if candidates:
            raise RestoreError(f"{self.root}: no committed snapshot restores; last error: {error}")
        return None

    def _finish(self, step: int, path: Path, started: float, error: OSError | None) -> None:
        """Commit a written snapshot, or (when any rank failed to write it) remove it and raise."""
        try:
            if error is None:
                self._commit(step, path, started)
                return
            failure = _first_error(str(error))
        except OSError as exc:
            failure = _first_error(str(exc))
        if _rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        _barrier()
        latest = self.latest()
        raise CheckpointError(f"{path}: saving step {step} failed ({failure}); the partial snapshot was removed and "
                              f"{latest or 'no snapshot'} stays the latest committed one")

    def _commit(self, step: int, path: Path, started: float) -> None:
        """Make this rank's files durable and checksum its share of them; then rank 0 writes the
        checksum record and, last, the commit marker, and records ``save_committed`` at once (so
        the event exists whenever the marker does). Raises OSError on a failed write."""
        error = None
        try:
            _fsync_tree(path)
        except OSError as exc:
            error = f"making files durable: {exc}"
        if (failure := _first_error(error)) is not None:  # also the barrier: every rank's files are durable
            raise OSError(failure)
        files = data_files(path, skip=(COMMIT_MARKER, COMMIT_MARKER + ".tmp"))
        rank, world_size = _rank(), _world_size()
        digests = {}
        try:
            digests = digest_files(path, files[rank::world_size])
        except OSError as exc:
            error = f"checksumming: {exc}"
        shares = _gather((error, digests))
        if (failure := next((e for e, _ in shares if e), None)) is not None:
            raise OSError(failure)
        if rank == 0:
            error = None
            try:
                write_checksums(path, {name: d for _, share in shares for name, d in share.items()})
                marker = {"step": step, "world_size": world_size, "committed_at": time.time()}
                tmp = path / (COMMIT_MARKER + ".tmp")
                with open(tmp, "w") as f:
                    json.dump(marker, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path / COMMIT_MARKER)
                _fsync_dir(path)
                self.events.record("save_committed", step=step, snapshot=str(path),
                                   seconds=time.perf_counter() - started)
            except OSError as exc:
                error = f"committing: {exc}"
        if (failure := _first_error(error)) is not None:
            raise OSError(failure)
        if rank == 0:
            self._prune(keep_also=path)
        _barrier()

    def _prune(self, keep_also: Path) -> None:
        """Keep the newest ``keep`` committed snapshots; drop uncommitted leftovers older than the
        newest commit. Never the snapshot just written or the one restored from."""
        committed = committed_snapshots(self.root)
        newest = committed[-1][0] if committed else -1
        protected = {keep_also, self._restored_from}
        leftovers = [p for s, p in list_snapshots(self.root) if s < newest and not is_committed(p)]
        doomed = [p for _, p in committed[: -self.keep]] + leftovers
        for path in doomed:
            if path not in protected:
                # Un-commit first: a process killed during the removal must not leave a directory
                # that looks committed with some of its files gone.
                (path / COMMIT_MARKER).unlink(missing_ok=True)
                shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class _PendingSave:
    step: int
    path: Path
    handle: Any  # torchsnapshot's PendingSnapshot
    started: float


def _check_dtypes(path: Path, app_state: Mapping[str, Any]) -> None:
    """Refuse, before writing anything, a tensor whose dtype the snapshot format cannot hold."""
    for key, obj in app_state.items():
        _, flattened = flatten(obj.state_dict(), prefix=key)
        for logical_path, value in flattened.items():
            if isinstance(value, torch.Tensor) and value.dtype not in ALL_SUPPORTED_DTYPES:
                raise CheckpointError(f"{path}: '{logical_path}' is {value.dtype}, which torchsnapshot cannot store "
                                      f"(it stores {', '.join(str(d) for d in ALL_SUPPORTED_DTYPES)}); cast it "
                                      "in state_dict()")


def _fsync_tree(path: Path) -> None:
    for directory, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _first_error(error: str | None) -> str | None:
    """The error of the lowest rank that has one (the same answer on every rank), else None."""
    return next((e for e in _gather(error) if e is not None), None)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
