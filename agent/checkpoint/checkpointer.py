"""Checkpointer: the save side's API. ``save`` stages the rank's state (a memory copy) and hands
it to a background writer; torchsnapshot writes it into the save's own directory, every rank makes
exactly its files durable and checksums them as it writes, and rank 0 commits the snapshot as
``step_<N>`` the moment every rank's part is durable. ``latest()`` and ``restore()`` only ever see
committed snapshots, so a crash at any point of a save leaves the previous one in charge.

The stages are modules of this package: stage, write, commit, retention, fallback.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import warnings
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torchsnapshot.flatten import flatten
from torchsnapshot.serialization import ALL_SUPPORTED_DTYPES

from agent import torch_private
from agent.checkpoint import compat
from agent.checkpoint.collectives import barrier, first_error, from_rank0, own_group, rank
from agent.checkpoint.commit import Commit, commit
from agent.checkpoint.dirs import committed_snapshots, is_committed, partial_dir, snapshot_dir, step_of
from agent.checkpoint.fallback import restore_first_good
from agent.checkpoint.retention import prune
from agent.checkpoint.stage import FixedState, Stager, read_state_dicts
from agent.checkpoint.write import limit_write_threads, write_snapshot
from agent.checkpoint.writer_priority import WriterPriority, check_writer_priority, lower_thread_priority
from agent.commit_notice import RESTORE_TIER, tell_pace, write_notice
from agent.config import load_config
from agent.errors import TorchreviveError
from agent.events import EventLog
from agent.memory.layout import wait_fetched
from agent.memory.saver import MemorySaver
from agent.worker import WorkerContext

SAVE_GROUP_TIMEOUT = timedelta(minutes=10)
"""The bound on any one collective of the background writer: a rank that dies in the middle of a
save fails the others' save after this long instead of the training's own timeout."""


MEMORY_FETCH_TIMEOUT_S = 600.0
"""How long a rank waits for its agent to pull a memory snapshot's files from the peers; past it,
the restore finds what is missing and falls back to storage with the other ranks."""
PACE_WINDOW = 16
"""The steps whose times give the steady step time the commit notice tells the agent."""
PACE_TOLD_AFTER = 3
"""How many of a round's step times (their median) the training thread waits for before it tells
the agent the round's pace; the round's first commit then tells a steadier one."""


class CheckpointError(TorchreviveError):
    """A save cannot go ahead (say, it would overwrite a committed snapshot), or it failed."""


class Checkpointer:
    """Saves and restores an ``app_state`` (name -> object with state_dict/load_state_dict).

    Args:
        dir: the directory holding ``step_<N>`` snapshots (shared by every rank).
        interval_steps: ``maybe_save`` saves when the step is a multiple of this (and at its first
            call, a save due before that was never committed).
        keep: how many committed snapshots retention keeps (>= 1).
        staging: copy the state into reused staging buffers (host memory: at most one more copy
            of the rank's state) and write and commit it in the background; False writes and
            commits within ``save``.
        on_busy: what a save does while the previous one is still being written: ``"wait"`` for
            it, or ``"skip"`` this save with a warning (all ranks decide together).
        verify: how much of a restored snapshot is checked against its checksums (see
            :func:`agent.restore`).
        restore_options: more keyword arguments for :func:`agent.restore` (io_threads,
            replicated, trust_pickles).
        events: where save and restore events go (default: the log the agent configured).
        round: this round's number, the fencing token a commit is checked against (default: the
            one the agent gives the worker; None outside an agent: no fencing).
        memory: the memory tier's saver (see :mod:`agent.memory`); None: storage only.
        commit_notice: where to tell the node's agent of each committed snapshot
            (:mod:`agent.commit_notice`); None: nobody is told.
        writer_nice: how low the threads that write the snapshot in the background, and the
            memory tier's writer, run: a niceness from 0 (training's priority) to 19, or ``"idle"``
            (Linux's SCHED_IDLE: only on CPU time training leaves).
        write_threads: snapshot writes in flight at once per rank (torchsnapshot's I/O concurrency,
            16 by its default), for every snapshot this process writes; the environment's
            ``TORCHSNAPSHOT_MAX_PER_RANK_IO_CONCURRENCY_OVERRIDE`` wins when set.
        direct_io: write snapshot files around the page cache (``O_DIRECT``) where the file
            system allows it: a save then costs training less CPU, and a restore on the same
            node reads from the disk, not from memory (see :mod:`agent.checkpoint.direct_write`).
        async_save: the earlier name of ``staging``, accepted with a DeprecationWarning until 0.3.
    """

    def __init__(
        self,
        dir: str | os.PathLike[str],
        *,
        interval_steps: int = 100,
        keep: int = 3,
        staging: bool = True,
        on_busy: Literal["wait", "skip"] = "wait",
        verify: Literal["off", "sample", "full"] = "sample",
        restore_options: Mapping[str, Any] | None = None,
        events: EventLog | None = None,
        round: int | None = None,
        memory: MemorySaver | None = None,
        commit_notice: str | None = None,
        writer_nice: WriterPriority = 10,
        write_threads: int = 2,
        direct_io: bool = True,
        async_save: bool | None = None,
    ) -> None:
        if async_save is not None:
            warnings.warn("Checkpointer(async_save=...) is deprecated and will be removed in 0.3: it is now "
                          "Checkpointer(staging=...)", DeprecationWarning, stacklevel=2)
            staging = async_save
        if interval_steps < 1 or keep < 1:
            raise ValueError(f"interval_steps ({interval_steps}) and keep ({keep}) must be >= 1")
        if wrong := check_writer_priority(writer_nice):
            raise ValueError(f"writer_nice: {wrong}")
        if write_threads < 1:
            raise ValueError(f"write_threads ({write_threads}) must be >= 1")
        if on_busy not in ("wait", "skip") or verify not in ("off", "sample", "full"):
            raise ValueError(f"on_busy must be 'wait' or 'skip' (got {on_busy!r}); verify 'off', 'sample' or "
                             f"'full' (got {verify!r})")
        compat.install()
        limit_write_threads(write_threads)
        self.root = Path(dir)
        self.interval_steps = interval_steps
        self.keep = keep
        self.staging = staging
        self.on_busy = on_busy
        self.restore_options = {"verify": verify, **(restore_options or {})}
        self.events = events or EventLog.for_worker()
        self.round = round if round is not None else WorkerContext.from_env().round
        self._stager = Stager() if staging else None
        self.writer_nice = writer_nice
        self.direct_io = direct_io
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchrevive-save",
                                          initializer=lower_thread_priority, initargs=(writer_nice,)) if staging else None
        self._group: dist.ProcessGroup | None = None
        self.memory = memory
        self.commit_notice = commit_notice
        self._in_flight: _InFlight | None = None
        self._restored_from: Path | None = None
        self._first_step_pending = False
        self._graphs_at_restore = 0
        self._step_times: deque[float] = deque(maxlen=PACE_WINDOW)
        """The last seconds between two consecutive steps' ``maybe_save`` calls."""
        self._last_step: tuple[int, float] | None = None
        self._pace_untold = False
        """The round restored, and its pace is not in the commit notice yet."""
        self._called = False
        """Whether ``maybe_save`` was called (its first call saves what a round's end missed)."""

    @classmethod
    def from_env(cls) -> Checkpointer:
        """A Checkpointer configured by the job config the agent handed to this rank."""
        ctx = WorkerContext.from_env()
        if ctx.rehearsal:
            raise CheckpointError("a joining node's rehearsal touches no snapshot: build the Checkpointer in the "
                                  "training function given to agent.run_resilient, not in its warm-up")
        config = load_config(ctx.config_path)
        directory = ctx.checkpoint_dir or config.checkpoint.dir
        if not directory:
            raise CheckpointError("no checkpoint directory: set checkpoint.dir in the job config "
                                  "(or --set checkpoint.dir=PATH)")
        return cls(
            directory,
            interval_steps=config.checkpoint.interval_steps,
            keep=config.checkpoint.keep,
            staging=config.checkpoint.staging,
            on_busy=config.checkpoint.on_busy,
            verify=config.checkpoint.verify,
            restore_options={"io_threads": config.restore.io_threads, "replicated": config.restore.replicated,
                             "trust_pickles": config.restore.trust_pickles, "pinned_mb": config.restore.pinned_mb},
            events=EventLog.for_worker(ctx),
            round=ctx.round,
            memory=_memory_saver(ctx, config.checkpoint.memory_interval_steps, config.checkpoint.writer_nice),
            commit_notice=_notice_path(ctx),
            writer_nice=config.checkpoint.writer_nice,
            write_threads=config.checkpoint.write_threads,
            direct_io=config.checkpoint.direct_io,
        )

    def latest(self) -> Path | None:
        """The newest committed snapshot, or None."""
        committed = committed_snapshots(self.root)
        return committed[-1][1] if committed else None

    def save(self, step: int, app_state: Mapping[str, Any]) -> bool:
        """Save ``app_state`` as ``step_<step>`` (every rank calls this with the same step).

        With staging, returns once the state is copied; the snapshot is committed in the
        background as soon as it is durable. Returns False when the save was skipped
        (``on_busy="skip"`` and the previous one is still being written, or a snapshot of this step
        is committed already: it is never overwritten). A failed save (say, a
        full disk on any one node) removes its partial snapshot and raises CheckpointError on
        every rank: here without staging, else at the next ``save``, ``maybe_save`` or ``wait``.
        The previous committed snapshot stays the latest.
        """
        if self._busy():
            busy_with = self._in_flight.step if self._in_flight else None
            warnings.warn(f"skipping the save of step {step}: step {busy_with} is still being written", stacklevel=2)
            self.events.record("save_skipped", step=step, busy_with=busy_with)
            return False
        self.wait()
        final = snapshot_dir(self.root, step)
        if is_committed(final):
            # Training went back past it (a restore fell back to an older snapshot): it stays as committed.
            warnings.warn(f"skipping the save of step {step}: {final} is committed already, and a committed "
                          "snapshot is never overwritten", stacklevel=2)
            self.events.record("save_skipped", step=step, committed=str(final))
            return False
        started = time.perf_counter()
        state_dicts = read_state_dicts(app_state)
        _check_dtypes(final, state_dicts)
        group = self._save_group()
        replicated = compat.replicated_patterns(app_state)
        if self._stager is None:
            live = {key: FixedState(state) for key, state in state_dicts.items()}
            self._write_and_commit(step, live, replicated, group, started, self.step_s())
            return True
        staged = self._stager.stage(state_dicts)
        future = self._writer.submit(self._write_and_commit, step, staged, replicated, group, started, self.step_s())
        self._in_flight = _InFlight(step, future)
        self.events.record("save_started", step=step, blocking_s=time.perf_counter() - started,
                           staged_bytes=self._stager.staged_bytes)
        return True

    def maybe_save(self, step: int, app_state: Mapping[str, Any]) -> bool:
        """Save when ``step`` is a multiple of ``interval_steps``; True when it did. The first call
        after ``restore`` (whether or not a snapshot existed) records the ``first_step_done``
        event: training is back (with the graphs torch.compile compiled in this process since).

        The first call of a Checkpointer also saves when the save last due before ``step`` was
        never committed and the next is more than half an interval away (a ``save_caught_up``
        event): an in-process round that ended at that step's ``Round.step_done``, or while its
        background save was written, went on from the state in memory without it, as does a
        round restored from the memory tier after a loss during that save; a later restore from
        storage would otherwise go back a whole interval more. Rank 0's view of the snapshots
        decides, for every rank."""
        self._time_step(step)
        if self._pace_untold and self.commit_notice and len(self._step_times) >= PACE_TOLD_AFTER:
            self._pace_untold = False
            if failed := tell_pace(self.commit_notice, statistics.median(self._step_times), step=step):
                self.events.record("commit_notice_failed", step=step, error=failed)
        if self._first_step_pending:
            self._first_step_pending = False
            self.events.record("first_step_done", step=step,
                               restored_from=str(self._restored_from) if self._restored_from else None,
                               compiled_graphs=torch_private.graphs_compiled() - self._graphs_at_restore,
                               **torch_private.compile_stats())
        first_call, self._called = not self._called, True
        if step % self.interval_steps == 0:
            return self.save(step, app_state)
        if first_call and (missed := self._missed_save(step)) is not None:
            self.events.record("save_caught_up", step=step, missed=missed)
            return self.save(step, app_state)
        if self.memory is not None and step % self.memory.interval_steps == 0:
            self.memory.save(step, read_state_dicts(app_state), compat.replicated_patterns(app_state),
                             step_s=self.step_s())
        return False

    def _missed_save(self, step: int) -> int | None:
        """The step of the storage save due last before ``step`` when no snapshot of it or newer
        is committed (rank 0's view, on every rank) and the next save is more than half an
        interval away (a save soon after would find this one still written), else None. A
        collective only where this Checkpointer did not restore that step or a newer one from
        storage (every rank restores the same)."""
        due = (step - 1) // self.interval_steps * self.interval_steps
        restored = self._restored_from
        if (due <= 0 or self.interval_steps - step % self.interval_steps <= self.interval_steps // 2
                or (restored is not None and restored.is_relative_to(self.root) and (step_of(restored) or 0) >= due)):
            return None
        committed = committed_snapshots(self.root) if rank() == 0 else None  # one listing of shared storage
        newest = from_rank0(committed[-1][0] if committed else 0)
        return due if newest < due else None

    def step_s(self) -> float | None:
        """The steady step time: the median of the last steps' (None before two steps)."""
        return statistics.median(self._step_times) if self._step_times else None

    def _time_step(self, step: int) -> None:
        now = time.monotonic()
        if self._last_step is not None and step == self._last_step[0] + 1:
            self._step_times.append(now - self._last_step[1])
        self._last_step = (step, now)

    def _commit_interval(self) -> int:
        """Steps between two commits of any tier."""
        return min(self.interval_steps, self.memory.interval_steps) if self.memory else self.interval_steps

    def wait(self) -> None:
        """Wait for the save in flight, if any, to be committed; CheckpointError if it failed.
        A memory snapshot in flight is waited for too (its failure is only reported)."""
        if self.memory is not None:
            self.memory.wait()
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            try:
                in_flight.future.result()
            except CheckpointError:
                raise
            except Exception as exc:  # a collective of the save group failed (a peer died, a timeout)
                raise CheckpointError(f"saving step {in_flight.step} failed in the background: {exc}") from exc

    def saving(self) -> bool:
        """Whether a save is still being written in the background (on this rank)."""
        return self._in_flight is not None and not self._in_flight.future.done()

    def restore(self, app_state: Mapping[str, Any]) -> int | None:
        """Restore the snapshot the agent chose for this round (TORCHREVIVE_RESTORE_FROM), else the
        latest committed one, and return its step (None when there is no snapshot yet).

        A snapshot that fails to restore on any rank (damaged, checksum mismatch) gives way to the
        previous committed one, with a warning and a ``restore_fallback`` event; all ranks move on
        together. A damaged one is quarantined (``step_<N>.quarantined``, a
        ``snapshot_quarantined`` event): no round restores it again, and a save of its step goes
        ahead. When none restores, RestoreError.
        """
        self.wait()
        self._first_step_pending = True
        self._graphs_at_restore = torch_private.graphs_compiled()
        chosen = WorkerContext.from_env().restore_from
        if chosen and self.memory is not None and Path(chosen).is_relative_to(self.memory.root):
            # The agent pulls the files this node lacks from its peers while the workers start.
            wait_fetched(Path(chosen), self.memory.round, timeout=MEMORY_FETCH_TIMEOUT_S)
        candidates = [p for _, p in reversed(committed_snapshots(self.root))]
        if chosen:
            candidates = [Path(chosen)] + [p for p in candidates if p != Path(chosen)]
        restored = restore_first_good(candidates, app_state, self.restore_options, self.events,
                                      fully_verified=self.memory.root if self.memory else None)
        if self.commit_notice:  # a restart from now on throws away what this round trains
            write_notice(self.commit_notice, step=step_of(restored[0]) if restored else 0, tier=RESTORE_TIER,
                         interval_steps=self._commit_interval())
            self._step_times.clear()  # the pace of this round, at its world size, is told a few steps in
            self._last_step = None
            self._pace_untold = True
        if restored is None:
            return None
        self._restored_from, stats = restored
        from_memory = self.memory is not None and self._restored_from.is_relative_to(self.memory.root)
        self.events.record("restore_done", snapshot=str(self._restored_from), step=step_of(self._restored_from),
                           bytes=stats.bytes_read, seconds=stats.seconds, gbps=stats.gbps,
                           bytes_verified=stats.bytes_verified, source="memory" if from_memory else "storage",
                           bytes_from_storage=0 if from_memory else stats.bytes_read)
        return step_of(self._restored_from)

    def _busy(self) -> bool:
        """Whether to skip this save: ``on_busy="skip"`` and the previous save is still being
        written on some rank (every rank gets the same answer)."""
        if self.on_busy != "skip" or self._in_flight is None:
            return False
        return first_error(None if self._in_flight.future.done() else "busy") is not None

    def _save_group(self) -> dist.ProcessGroup | None:
        """The save's own process group (gloo, created once by every rank at its first save), so
        that its collectives never interleave with the training's; None outside a group."""
        if self._group is None:
            self._group = own_group(SAVE_GROUP_TIMEOUT)
        return self._group

    def _write_and_commit(self, step: int, state: dict[str, Any], replicated: list[str],
                          group: dist.ProcessGroup | None, started: float, step_s: float | None) -> None:
        """Write, make durable and commit one snapshot on every rank of ``group``; then retention.
        Raises CheckpointError, the same on every rank, when any rank failed. ``step_s``: the
        steady step time for the commit notice, taken on the training thread (which records it)."""
        save = Commit(step, partial_dir(self.root, step, self.round), snapshot_dir(self.root, step), self.round)
        if rank(group) == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(save.written, ignore_errors=True)  # a leftover of a failed save of this round
        barrier(group)
        record = write_snapshot(save.written, state, replicated=replicated, group=group, priority=self.writer_nice,
                                direct=self.direct_io)

        def committed(nbytes: int) -> None:
            self.events.record("save_committed", step=step, snapshot=str(save.final),
                               seconds=time.perf_counter() - started, bytes=nbytes)

        error = commit(save, record, group, on_committed=committed)
        if error is not None:
            raise CheckpointError(f"{save.final}: saving step {step} failed ({error}); the partial snapshot was "
                                  f"removed and {self.latest() or 'no snapshot'} stays the latest committed one")
        if self.commit_notice and (failed := write_notice(self.commit_notice, step=step, tier="storage",
                                                          step_s=step_s, interval_steps=self._commit_interval())):
            self.events.record("commit_notice_failed", step=step, error=failed)  # the save is committed all the same
        if rank(group) == 0:
            prune(self.root, self.keep, protected=(save.final, self._restored_from))


def _memory_saver(ctx: WorkerContext, interval_steps: int, writer_nice: WriterPriority) -> MemorySaver | None:
    """The memory tier's saver, when the job turns it on and the agent gave this rank a memory dir."""
    if not interval_steps or not ctx.memory_dir or ctx.round is None:
        return None
    return MemorySaver(Path(ctx.memory_dir), interval_steps=interval_steps, buddy=ctx.memory_buddy, round=ctx.round,
                       local_rank=ctx.local_rank, events=EventLog.for_worker(ctx), commit_notice=_notice_path(ctx),
                       writer_nice=writer_nice)


def _notice_path(ctx: WorkerContext) -> str | None:
    """Where this rank tells its agent of commits: the node's local rank 0 does, for the node."""
    return ctx.commit_notice if ctx.local_rank == 0 else None


@dataclass(frozen=True)
class _InFlight:
    step: int
    future: Future[None]


def _check_dtypes(path: Path, state_dicts: Mapping[str, Any]) -> None:
    """Refuse, before writing anything, a tensor whose dtype the snapshot format cannot hold."""
    for key, state in state_dicts.items():
        _, flattened = flatten(state, prefix=key)
        for logical_path, value in flattened.items():
            if isinstance(value, torch.Tensor) and value.dtype not in ALL_SUPPORTED_DTYPES:
                raise CheckpointError(f"{path}: '{logical_path}' is {value.dtype}, which torchsnapshot cannot store "
                                      f"(it stores {', '.join(str(d) for d in ALL_SUPPORTED_DTYPES)}); cast it "
                                      "in state_dict()")
