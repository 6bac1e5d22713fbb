"""The memory directory of a node's agent for one rendezvous run: ``<base>/torchrevive-<run id>``.

Node RAM (a tmpfs such as /dev/shm) is shared by every job and user of the node, and it outlives
an agent that is SIGKILLed. So an agent makes its run's directory itself, never taking one that
exists (mode 700, under a base directory that no other user can write to), and holds a lock on a
file in it for as long as it lives. A directory of the run that is there already is a dead
agent's when this user owns it and its lock is free (or it has none: an older layout's): it is
removed first, with whatever snapshots it held. One a live agent holds, or another user's, is
never touched: the agent stops with an error. At the end the agent removes its own directory.

The name has no per-agent nonce: torchsnapshot writes every rank's files under rank 0's path, so
a memory snapshot's path must be the same on every node of the job.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import stat
from pathlib import Path

from agent.errors import TorchreviveError

DEFAULT_BASE = "/dev/shm"
"""Where run directories are made unless ``checkpoint.memory_dir`` says otherwise."""
LOCK_FILE = ".torchrevive_lock"
"""Held (flock) by the live agent that made the directory."""
RUN_FILE = ".torchrevive_run"
"""The rendezvous run id, for the node's workers: each memory snapshot's commit marker names it."""
_ATTEMPTS = 5
logger = logging.getLogger(__name__)


class MemoryDirError(TorchreviveError):
    """The memory tier's directory is unsafe to use (another user's, or writable by others)."""


class RunDir:
    """This agent's memory directory (see the module doc); :meth:`close` removes it.

    Args:
        base: where run directories are made (``checkpoint.memory_dir``; created, mode 700, when
            missing). It must be this user's or root's, and writable by no one else unless it has
            the sticky bit (as /dev/shm).
        run_id: the rendezvous run id (torchrun's ``--rdzv-id``, ``job.id``).
    """

    def __init__(self, base: Path, run_id: str) -> None:
        self.base, self.run_id = Path(base), run_id
        check_base(self.base)
        self.path = self.base / f"torchrevive-{re.sub(r'[^A-Za-z0-9_.-]', '_', run_id).lstrip('.')[:64] or '_'}"
        self._lock = self._make()
        try:
            (self.path / RUN_FILE).write_text(run_id)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove this run's directory (and only it), then release its lock."""
        if self._lock < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)
        self._lock = -1

    def _make(self) -> int:
        """Make the directory here and now (a dead agent's removed first); its lock, held."""
        for _ in range(_ATTEMPTS):
            try:
                os.mkdir(self.path, 0o700)  # never exist_ok: a directory that exists is not this agent's
            except FileExistsError:
                self._remove_dead()
                continue
            except OSError as exc:
                raise MemoryDirError(f"{self.path}: cannot make the memory directory ({exc.strerror}); set "
                                     "checkpoint.memory_dir to a directory of your own") from exc
            os.chmod(self.path, 0o700)  # mkdir's mode is cut by the umask; the agent needs rwx
            try:
                lock = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileNotFoundError:
                continue  # removed meanwhile
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.fstat(lock).st_nlink:
                return lock
            # Another agent starting locked the lock file first, took the directory for a dead
            # agent's, and removed it: try again.
            os.close(lock)
        raise MemoryDirError(f"{self.path}: could not make this run's memory directory in {_ATTEMPTS} attempts "
                             "(another agent of the same run on this node removed it each time); run one agent per "
                             "run and node")

    def _remove_dead(self) -> None:
        """Remove the run's directory that is there when its agent is gone; MemoryDirError when
        it is another user's, not a directory, or a live agent's."""
        info = os.lstat(self.path)
        if not stat.S_ISDIR(info.st_mode):
            raise MemoryDirError(f"{self.path}: in the way of this run's memory directory and not a directory; "
                                 "remove it, or set checkpoint.memory_dir to a directory of your own")
        _check_owned(self.path, info, what="a memory directory of this run")
        try:
            lock = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            lock = -1  # an older layout's, or one being made: an agent of this run making it retries
        try:
            if lock >= 0:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MemoryDirError(f"{self.path}: another agent of run {self.run_id!r} on this node uses it (it holds "
                                 f"{LOCK_FILE}); give each job its own --rdzv-id (job.id), or each agent its own "
                                 "checkpoint.memory_dir") from None
        try:  # removed while locked: an agent making it meanwhile sees its lock file unlinked
            shutil.rmtree(self.path, ignore_errors=True)
            logger.info("removed %s: the memory directory of an agent of this run that is gone", self.path)
        finally:
            if lock >= 0:
                os.close(lock)


def check_base(base: Path) -> None:
    """Make ``base`` when missing; MemoryDirError when another user could read or replace what is
    made in it."""
    try:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.stat(base)
    except OSError as exc:
        raise MemoryDirError(f"{base}: cannot make the memory tier's base directory (checkpoint.memory_dir): "
                             f"{exc.strerror}; set it to a directory of your own on a tmpfs") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise MemoryDirError(f"{base}: not a directory; set checkpoint.memory_dir to a directory of your own "
                             "on a tmpfs (default /dev/shm)")
    _check_owned(base, info, what="the memory tier's base directory (checkpoint.memory_dir)", root_ok=True)
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise MemoryDirError(f"{base}: the memory tier's base directory (checkpoint.memory_dir) is writable by "
                             f"other users (mode {oct(info.st_mode & 0o7777)}) without the sticky bit: they could "
                             f"remove or replace this job's memory snapshots. chmod go-w {base} (or +t, as "
                             "/dev/shm), or set checkpoint.memory_dir to a directory of your own")


def read_run(root: Path) -> str:
    """The run id the agent wrote in its memory directory ``root`` (for the node's workers)."""
    try:
        return (root / RUN_FILE).read_text()
    except OSError as exc:
        raise MemoryDirError(f"{root / RUN_FILE}: cannot read the memory tier's run id ({exc.strerror}); is the "
                             "node's agent running with the memory tier on?") from exc


def _check_owned(path: Path, info: os.stat_result, *, what: str, root_ok: bool = False) -> None:
    owners = {os.getuid(), 0} if root_ok else {os.getuid()}
    if info.st_uid not in owners:
        raise MemoryDirError(f"{path}: {what} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}): "
                             "another user could read or replace this job's memory snapshots. Set "
                             "checkpoint.memory_dir to a directory of your own")
