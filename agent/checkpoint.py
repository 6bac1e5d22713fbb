"""Checkpointer: snapshots written by torchsnapshot into ``<dir>/step_<N>``, committed atomically,
found again by ``latest()``, pruned by retention, and restored through the restore engine.

A snapshot is *committed* once its marker file exists. The marker is written last, by rank 0,
after every rank has made its files durable (fsync of files and directories). Restore only ever
picks committed snapshots, so a crash at any point of a save leaves the previous one in charge.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchsnapshot

from agent.config import load_config
from agent.errors import RestoreError, TorchreviveError
from agent.restore import restore as restore_snapshot
from agent.worker import WorkerContext

COMMIT_MARKER = ".torchrevive_commit"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(TorchreviveError):
    """A save cannot go ahead (say, it would overwrite a committed snapshot)."""


def snapshot_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def is_committed(path: Path) -> bool:
    """Whether a snapshot directory carries its commit marker."""
    return (path / COMMIT_MARKER).is_file()


def step_of(path: Path) -> int | None:
    """N for a ``step_<N>`` directory, else None."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def list_snapshots(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_<N>`` directory under ``root``, committed or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((step, p) for p in root.iterdir() if (step := step_of(p)) is not None and p.is_dir())


def committed_snapshots(root: Path) -> list[tuple[int, Path]]:
    """The committed ``step_<N>`` snapshots under ``root``, oldest first."""
    return [(step, p) for step, p in list_snapshots(root) if is_committed(p)]


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
        restore_options: keyword arguments for :func:`agent.restore` (io_threads, replicated,
            trust_pickles).
    """

    def __init__(
        self,
        dir: str | os.PathLike[str],
        *,
        interval_steps: int = 100,
        keep: int = 3,
        async_save: bool = True,
        restore_options: Mapping[str, Any] | None = None,
    ) -> None:
        if interval_steps < 1 or keep < 1:
            raise ValueError(f"interval_steps ({interval_steps}) and keep ({keep}) must be >= 1")
        self.root = Path(dir)
        self.interval_steps = interval_steps
        self.keep = keep
        self.async_save = async_save
        self.restore_options = dict(restore_options or {})
        self._pending: tuple[int, Path, Any] | None = None
        self._restored_from: Path | None = None

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
            restore_options={"io_threads": config.restore.io_threads, "replicated": config.restore.replicated,
                             "trust_pickles": config.restore.trust_pickles},
        )

    def latest(self) -> Path | None:
        """The newest committed snapshot, or None."""
        committed = committed_snapshots(self.root)
        return committed[-1][1] if committed else None

    def save(self, step: int, app_state: Mapping[str, Any]) -> None:
        """Write ``app_state`` as ``step_<step>`` (every rank calls this with the same step)."""
        self.wait()
        path = snapshot_dir(self.root, step)
        if is_committed(path):
            raise CheckpointError(f"{path}: a committed snapshot of step {step} exists; it is never overwritten")
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if path.exists():  # an uncommitted leftover of a crashed save of this same step
                shutil.rmtree(path)
        _barrier()
        if self.async_save and dist.is_initialized():
            self._pending = (step, path, torchsnapshot.Snapshot.async_take(str(path), dict(app_state)))
        else:
            torchsnapshot.Snapshot.take(str(path), dict(app_state))
            self._commit(step, path)

    def maybe_save(self, step: int, app_state: Mapping[str, Any]) -> bool:
        """Save when ``step`` is a multiple of ``interval_steps``; True when it did."""
        if step % self.interval_steps:
            return False
        self.save(step, app_state)
        return True

    def wait(self) -> None:
        """Complete and commit the save in flight, if any."""
        if self._pending is None:
            return
        step, path, pending = self._pending
        self._pending = None
        pending.wait()
        self._commit(step, path)

    def restore(self, app_state: Mapping[str, Any]) -> int | None:
        """Restore the snapshot the agent chose for this round (TORCHREVIVE_RESTORE_FROM), else the
        latest committed one, and return its step (None when there is no snapshot yet).

        A snapshot that fails to restore on any rank gives way to the previous committed one,
        with a warning; all ranks move on together. When none restores, RestoreError.
        """
        self.wait()
        chosen = WorkerContext.from_env().restore_from
        candidates = [p for _, p in reversed(committed_snapshots(self.root))]
        if chosen:
            candidates = [Path(chosen)] + [p for p in candidates if p != Path(chosen)]
        failures = []
        for path in candidates:
            try:
                restore_snapshot(path, app_state, **self.restore_options)
                ok = True
            except RestoreError as exc:
                failures.append(str(exc))
                ok = False
            if _all_ranks(ok):
                self._restored_from = path
                return step_of(path)
            warnings.warn(f"falling back from {path}: {failures[-1] if failures else 'another rank failed'}",
                          stacklevel=2)
        if candidates:
            raise RestoreError(f"{self.root}: no committed snapshot restores; last error: "
                               f"{failures[-1] if failures else 'on another rank'}")
        return None

    def _commit(self, step: int, path: Path) -> None:
        """Make this rank's files durable, then (after all ranks did) rank 0 writes the marker."""
        _fsync_tree(path)
        _barrier()
        if _rank() == 0:
            marker = {"step": step, "world_size": _world_size(), "committed_at": time.time()}
            tmp = path / (COMMIT_MARKER + ".tmp")
            with open(tmp, "w") as f:
                json.dump(marker, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path / COMMIT_MARKER)
            _fsync_dir(path)
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
                shutil.rmtree(path, ignore_errors=True)


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


def _all_ranks(flag: bool) -> bool:
    """True when ``flag`` is true on every rank."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
