"""In-process recovery, the worker's side: a re-entrant training function that the process runs
once per round, across membership changes, without a restart (``elastic.in_process: true``).

::

    model, optimizer = build()                 # outside: lives across rounds
    def train(round: agent.Round) -> None:     # inside: what depends on the world
        ddp = DistributedDataParallel(model, init_sync=False)
        sampler = agent.ElasticSampler(...)
        ckpt = agent.Checkpointer.from_env()
        app_state = {"model": model, "optim": optimizer, "data": sampler}
        start = round.heal(app_state)           # from a live peer's memory, else None
        if start is None:
            start = ckpt.restore(app_state) or 0
        for step in range(start, total):
            train_step(ddp, ...)
            round.step_done(step + 1)           # after the optimizer step (and its logging)
            ckpt.maybe_save(step + 1, app_state)
    agent.run_resilient(train)

Each round :func:`run_resilient` joins the default process group from the round's environment and
calls ``train``. When the agent asks the round to end (a node was lost, hung or joined: then the
step in flight may finish first), or a collective fails because a peer is gone, the round's TCP
connections are cut
(:mod:`agent.round_sockets`: peers blocked on them error out at once), the worker tells its agent
it left and the step it holds, waits for the next round's environment, and calls ``train`` again.
Any other exception ends the process, as without in-process recovery: the agent restarts it.
Without an agent that runs rounds in-process, ``train`` runs once.

Keep outside ``train`` what outlives a world: the model's parameters and optimizer (for DDP), the
dataset, compiled code, the device context. Build inside it what depends on the world: the DDP or
FSDP2 wrapper, the sampler, the Checkpointer, any further process group. Sharded state (FSDP2's
modules, passed in ``app_state`` as themselves) heals from the ranks' memory when they hold every
shard (a join), else restores through the Checkpointer; tensor parallel's always restores.

With an agent that runs rounds in-process, what is alive when :func:`run_resilient` starts is
frozen (``gc.freeze``): the collection at each round's end scans only what the rounds made, and a
reference cycle made before then is never collected.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from agent import regroup, torch_private
from agent.events import EventLog
from agent.round_sockets import RoundConnections, open_sockets
from agent.worker import REGROUP_DIR, REHEARSAL_ROUND, WorkerContext

T = TypeVar("T")

FINISH_MARGIN_MIN_S = 0.5
"""The least time a step let finish gets beyond what it has left: short steps vary more than half
their length, and a worker's thread may wait for the CPU."""
_COLLECTIVE_FAILURES = ("gloo", "nccl", "connection closed by peer", "connection reset", "broken pipe")


class RoundEnded(Exception):
    """The agent ended this round: the training function leaves it."""


class Round:
    """One round of a re-entrant training function: the round's context, the step this process
    holds, and the agent's request to leave."""

    def __init__(self, context: WorkerContext, number: int, held_step: int | None, events: EventLog,
                 leave: threading.Event, previous_state: Mapping[str, Any] | None = None) -> None:
        self.context = context
        self.number = number
        """How many rounds this process ran before this one (0: its first)."""
        self.held_step = held_step
        """The step whose state this process holds in memory (None: none yet)."""
        self.events = events
        self.app_state: Mapping[str, Any] | None = None
        """What this round passed to :meth:`heal` (healed, or restored by the training function when
        the heal could not): the next round heals from it."""
        self._previous_state = previous_state
        self._leave = leave
        self._healed = False
        self._graphs_at_start = torch_private.graphs_compiled()
        self._last_step_at: float | None = None
        self._step_s: float | None = None
        """The time between this round's last two ``step_done`` calls."""
        self.cut = False
        """Whether the round's connections were cut under the training thread (it did not end the
        round at a step's end)."""

    @property
    def kept_state(self) -> Mapping[str, Any] | None:
        """What the next round heals from: this round's state once it healed, else the last round's."""
        return self.app_state if self.app_state is not None else self._previous_state

    @property
    def leave_requested(self) -> bool:
        """Whether the agent asked this round to end (``step_done`` then raises RoundEnded)."""
        return self._leave.is_set()

    def heal(self, app_state: Mapping[str, Any]) -> int | None:
        """Bring every rank to the newest step one of them holds, from the ranks' memory; the step,
        or None when they cannot (restore from a snapshot then): no rank holds any, or, for sharded
        state (FSDP2's DTensors, re-laid to this round's mesh: :mod:`agent.heal_sharded`), a shard
        of it went with a lost node. An object of replicated state built anew for this round (a
        sampler, say) first takes the state of the one under its key in this process's previous
        round. Collective: every rank of the round calls it."""
        from agent.heal import carry_over, heal
        from agent.heal_sharded import heal_sharded, holds_dtensors

        previous = self._previous_state
        if holds_dtensors(app_state):
            healed = heal_sharded(app_state, previous, self.held_step)
        else:
            if previous is not None:
                carry_over(previous, app_state)
            healed = heal(app_state, self.held_step)
        # Healed (or not, every rank knowing it): this round's objects are what the next heals
        # from, and the last round's go. A round that ends within the heal keeps the last round's.
        self.app_state, self._previous_state = app_state, None
        if healed is None:
            self.held_step = None  # this round's objects hold no step until one is restored or done
            return None
        self._healed = True
        self.held_step = healed.step
        self.events.record("restore_done", snapshot=None, step=healed.step, bytes=healed.bytes,
                           seconds=healed.seconds, source="peer" if healed.sources else "in_process",
                           from_ranks=list(healed.sources), bytes_from_storage=0)
        return healed.step

    def step_done(self, step: int) -> None:
        """Record that this process now holds the state of ``step`` (call it after the optimizer
        step and whatever logs the step, before any later collective); raises RoundEnded when the
        agent asked the round to end, which a join lets come here, at the step's end. The first
        call after a heal records ``first_step_done``."""
        if self._healed:
            self._healed = False
            self.events.record("first_step_done", step=step, restored_from=None, path="in_process",
                               compiled_graphs=torch_private.graphs_compiled() - self._graphs_at_start)
        self.held_step = step
        now = time.monotonic()
        if self._last_step_at is not None:
            self._step_s = now - self._last_step_at
        self._last_step_at = now
        if self._leave.is_set():
            raise RoundEnded(f"round {self.context.round} ended by the agent at the end of step {step}")

    def time_to_finish_step(self, allowed_s: float) -> float:
        """How long to let the step in flight run to its end, when the agent allows up to
        ``allowed_s``: what it has left, timed like the round's last step, and a margin of half a
        step (at least :data:`FINISH_MARGIN_MIN_S`; a step already late gets only the margin),
        within ``allowed_s``. 0 (leave at once) when it would end later, when no step of this round
        was timed yet, or when the training function does not call :meth:`heal` (its state
        restores from a snapshot each round: a step after the last commit is thrown away whether
        it finishes or not)."""
        if allowed_s <= 0 or self.app_state is None or self._step_s is None or self._last_step_at is None:
            return 0.0
        remaining = max(self._step_s - (time.monotonic() - self._last_step_at), 0.0)
        margin = max(self._step_s / 2, FINISH_MARGIN_MIN_S)
        return min(remaining + margin, allowed_s) if remaining <= allowed_s else 0.0


def run_resilient(train: Callable[[Round], T], *, backend: str | None = None,
                  timeout: datetime.timedelta | None = None, warmup: Callable[[Round], None] | None = None) -> T:
    """Run ``train`` once per round until it returns, re-forming the default process group (of
    ``backend``: NCCL on CUDA, else gloo; with ``timeout``, by default the job's
    ``elastic.process_group_timeout``) in-process when the agent runs rounds so.

    ``warmup`` runs when this process starts ahead of its node's first round (a node joining a
    running job rehearses, :mod:`agent.rehearsal`), with the default group formed by the node's own
    workers alone: build, shard and compile the model and run a step on synthetic data, touching
    no snapshot and no data position. Its compiled code serves the rounds that follow, so the job
    does not wait for this node's compile."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    directory = os.environ.get(REGROUP_DIR) or None
    if directory is not None:  # the agent asks a worker late to leave a round where it is stuck
        # Chained only to a handler of the program's own: the default one would end the process.
        chain = signal.getsignal(regroup.STACK_DUMP_SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        faulthandler.register(regroup.STACK_DUMP_SIGNAL, all_threads=True, chain=chain)
        gc.freeze()  # what outlives rounds (modules, the kept model): a round's end collects only what rounds made
    number, held, previous_state = 0, None, None
    ended: RoundConnections | None = None  # the last round's connections, held open (agent.round_sockets)
    while True:
        connections = RoundConnections(open_sockets())
        context = WorkerContext.from_env()
        if context.rehearsal and directory is not None:
            _rehearse(context, warmup, backend, timeout, directory)
            continue
        leave = threading.Event()
        round = Round(context, number, held, EventLog.for_worker(context), leave, previous_state)
        previous_state = None  # the round holds it, and lets it go once healed (FSDP2's: a second copy of the state)
        # Watching from before the group forms: a peer lost meanwhile leaves this worker waiting
        # in the group's rendezvous, and cutting the store connection frees it.
        watcher = _LeaveWatcher(directory, round, leave, connections, backend) if directory else None
        try:
            if directory is not None and _leave_request(directory, context.round) is not None:
                leave.set()  # asked before the group formed (a join during the start): nothing to join
                raise RoundEnded(f"round {context.round} ended before its group formed")
            dist.init_process_group(backend, timeout=timeout or context.process_group_timeout)
            return train(round)
        except Exception as exc:
            if directory is None or context.round is None or not (leave.is_set() or _collective_failed(exc)):
                raise
            if not leave.is_set():
                reason = f"a collective failed: {exc}"
            else:  # a RoundEnded from step_done says at which step's end, unless the round was cut
                reason = str(exc) if isinstance(exc, RoundEnded) and not round.cut else "asked by the agent"
        finally:
            if watcher is not None:
                watcher.stop()
        # Every read of the round ends; a background save's sends still go out (agent.round_sockets).
        connections.shut(socket.SHUT_RD)
        from agent.heal_sharded import holds_dtensors

        held, previous_state = round.held_step, round.kept_state
        sharded = round.app_state is not None and holds_dtensors(round.app_state)
        # Told first: the agent re-forms the job while this process cleans up.
        regroup.post_left(directory, context.local_rank,
                          regroup.Left(round=context.round, reason=reason[:500], step=held, pid=os.getpid(),
                                       healed=round.app_state is not None, sharded=sharded))
        del round
        gc.collect()  # the round's DDP reducers unhook from the kept parameters
        _leave_process_group(backend)
        connections.shut(socket.SHUT_RDWR)
        connections.quiet()  # the groups left live on: their event loops must not spin on these
        os.environ.update(_wait_for_handover(directory, context.local_rank, context.round))
        if ended is not None:  # a peer still sending on them (frozen meanwhile, say) has been told by now
            ended.release()
        ended = connections
        number += 1


def _rehearse(context: WorkerContext, warmup: Callable[[Round], None] | None, backend: str,
              timeout: datetime.timedelta | None, directory: str) -> None:
    """A joining node's rehearsal: the warm-up in a group of this node's workers, then leave it
    and wait for the first round of the job."""
    if warmup is not None:
        dist.init_process_group(backend, timeout=timeout or context.process_group_timeout)
        events, started = EventLog.for_worker(context), time.monotonic()
        warmup(Round(context, 0, None, events, threading.Event()))
        events.record("warmup_done", seconds=time.monotonic() - started,
                      compiled_graphs=torch_private.graphs_compiled(), **torch_private.compile_stats())
        # A rehearsal ends healthy: every rank's collectives (queued, on a GPU) finish before any
        # rank leaves the group, which is then destroyed, not aborted.
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        gc.collect()
        torch_private.forget_device_meshes()
        dist.destroy_process_group()
    regroup.post_left(directory, context.local_rank,
                      regroup.Left(round=REHEARSAL_ROUND, reason="rehearsed", step=None, pid=os.getpid()))
    os.environ.update(_wait_for_handover(directory, context.local_rank, REHEARSAL_ROUND))


class _LeaveWatcher:
    """Polls the agent's leave request; when it comes, flags the round (``step_done`` then ends
    it) and cuts its connections (a training thread blocked in a collective errors out): at once,
    or, when the agent allows the step in flight to finish (a join) and it ends in time, only if
    the round did not end by then."""

    def __init__(self, directory: str, round: Round, leave: threading.Event, connections: RoundConnections,
                 backend: str, poll_s: float = 0.02) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(directory, round, leave, connections, backend, poll_s),
                                        name="torchrevive-leave-watch", daemon=True)
        self._thread.start()

    def _run(self, directory: str, round: Round, leave: threading.Event, connections: RoundConnections,
             backend: str, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            request = _leave_request(directory, round.context.round)
            if request is None:
                continue
            leave.set()
            if self._step_ends_in_time(directory, round, request, poll_s):
                return  # the round ended (at the step's end, say): run_resilient cuts its connections
            round.cut = True
            if backend == "nccl":  # its communicators do not use these connections (untested: no GPU here)
                torch_private.abort_process_group()
            connections.cut(self._stop)  # the training thread may be sending
            return

    def _step_ends_in_time(self, directory: str, round: Round, request: regroup.LeaveRequest, poll_s: float) -> bool:
        """Whether the round ends by itself within the time ``request`` lets its step in flight
        finish; a later request to leave at once (a node lost meanwhile) ends the wait."""
        until = time.monotonic() + round.time_to_finish_step(request.finish_step_s)
        while (left := until - time.monotonic()) > 0:
            if self._stop.wait(min(poll_s, left)):
                return True
            later = _leave_request(directory, round.context.round)
            if later is not None and later.finish_step_s == 0:
                return False
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _leave_request(directory: str, round: int | None) -> regroup.LeaveRequest | None:
    """The agent's request to end ``round`` (or a later one), or None."""
    asked = regroup.leave_requested(directory)
    return asked if asked is not None and round is not None and asked.round >= round else None


def _collective_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it came from) is a collective's failure: a peer left."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, dist.DistError) or (
                isinstance(seen, RuntimeError) and any(s in str(seen).lower() for s in _COLLECTIVE_FAILURES)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


_departed: list[Any] = []
"""Process groups of rounds that ended: kept referenced, since destroying a gloo group whose
reducer still holds it can deadlock (see examples/worker_process.py); their connections are cut."""


def _leave_process_group(backend: str) -> None:
    torch_private.forget_device_meshes()
    if not dist.is_initialized():  # aborted already, or its init failed (a peer left meanwhile)
        torch_private.forget_failed_group_init()
        return
    if backend == "nccl":
        torch_private.abort_process_group()
        return
    _departed.append(dist.group.WORLD)
    dist.destroy_process_group()


def _wait_for_handover(directory: str, local_rank: int, round: int) -> dict[str, str]:
    """The next round's environment, once the agent hands it over (it stops this process instead
    when the round goes down the restart path); the agent is told it was taken."""
    while True:
        handed = regroup.read_handover(directory, local_rank, after=round)
        if handed is not None:
            regroup.post_taken(directory, local_rank, handed[0])
            return handed[1]
        time.sleep(0.01)
