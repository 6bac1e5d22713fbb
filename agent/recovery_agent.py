"""The per-node recovery agent: torch.distributed.elastic's LocalElasticAgent, extended to

* watch the rendezvous for lost, hung and joining nodes and its own eviction, and stop its
  workers at once on any change instead of waiting for a collective to time out; a peer whose
  agent process died is seen lost from its closed connection (:mod:`agent.liveness`), without
  waiting for its heartbeats to lapse;
* re-form as soon as every live node joined the next round, not at torch's last call;
* count only real worker failures against ``max_restarts`` (a failure caused by a lost peer is a
  membership change, as torchrun already treats a joining node);
* give each round's workers a fresh store, the snapshot the round's leader chose, the gradient
  accumulation steps for the new world size, and the TORCHREVIVE_* contract; what the agents
  read from the rendezvous store is data, checked before use (the state before torch unpickles
  it, :mod:`agent.rendezvous.checked_backend`; the round's values,
  :mod:`agent.rendezvous.round_values`), and a finished round's keys are deleted
  (:mod:`agent.rendezvous.round_keys`);
* fork each round's workers from a warm process that has already imported torch
  (:mod:`agent.warm_workers`), spawning them as torch does when it cannot;
* warm the page cache with the node's share of that snapshot while the workers start;
* with the memory tier on, serve the node's memory snapshots to its peers and restore from the
  newest one the live nodes hold together (:mod:`agent.memory`);
* record every phase as an event (and in Prometheus metrics when a port is configured).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousInfo, RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
)

from agent import health, regroup, rehearsal, torch_private, worker
from agent.commit_notice import read_notice
from agent.compile_cache import CompileCache, CompileCacheError, Shared, fetch_shared
from agent.config import ConfigError, JobConfig
from agent.errors import RestoreError, StaleRoundError
from agent.events import EventLog, Metrics
from agent.liveness import PeerLiveness
from agent.membership import Change, MembershipWatch
from agent.memory.layout import MemorySnapshot
from agent.memory.peer_files import PeerError
from agent.memory.run_dir import DEFAULT_BASE
from agent.memory.tier import MemoryTier
from agent.recovery_states import ConfirmLoss, DeferJoin, Fail, Finish, Recover, RecoveryMachine
from agent.rendezvous import round_values
from agent.rendezvous.checked_backend import CheckedBackend
from agent.rendezvous.prompt import PromptOpExecutor
from agent.rendezvous.round_keys import RESTORE_FROM_KEY, WORKER_STORE_KEY, FinishedRound, delete_keys
from agent.rendezvous.round_values import MEMORY_CHOICE, RoundLeftBehind
from agent.checkpoint.dirs import committed_snapshots, write_fence
from agent.warm_workers import (
    SpawnedSubprocessHandler,
    WarmProcess,
    WarmSubprocessHandler,
    become_subreaper,
    keep_reaping_orphans,
    reap_orphans,
)

JOB_SUCCEEDED_KEY = "torchrevive/job_succeeded"

logger = logging.getLogger(__name__)


class RecoveryAgent(LocalElasticAgent):
    """A LocalElasticAgent that detects membership changes and hands each round its restore.

    Args:
        job: the resolved job config.
        config_path: where the resolved config was written; workers read it from
            ``TORCHREVIVE_CONFIG``.
        *args, **kwargs: as for LocalElasticAgent.
    """

    def __init__(self, *args: Any, job: JobConfig, config_path: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._job = job
        self._config_path = config_path
        self._prev_world_size: int | None = None
        self._worker_store: dist.TCPStore | None = None
        self._restore_from: str = ""
        self._round: int | None = None
        self._round_nodes: frozenset[str] = frozenset()
        """The other participants of the round this node last joined, as its rendezvous completed."""
        self._finished_round: FinishedRound | None = None
        """This node's last round, whose keys go once a later round formed."""
        self._keys_to_delete: FinishedRound | None = None
        """The round whose keys this node deletes once the current round's workers started."""
        self._grad_accum_steps = 1
        handler = self._worker_group.spec.rdzv_handler
        self._nproc_per_node = self._worker_group.spec.local_world_size
        self._standby = False
        self._nodes_used = 0
        self._executor: PromptOpExecutor | None = None
        self._watch: MembershipWatch | None = None
        self._liveness: PeerLiveness | None = None
        if isinstance(handler, DynamicRendezvousHandler):
            # torch unpickles the state its backend returns: only what the allowlist accepted.
            CheckedBackend.install(handler, f"the {handler.get_backend()} rendezvous state of run "
                                            f"'{handler.settings.run_id}' (at {job.rendezvous.endpoint})")
            keep_alive = handler.settings.keep_alive_interval.total_seconds()
            self._executor = PromptOpExecutor.install(handler, poll_interval=keep_alive / 10)
            self._watch = MembershipWatch(handler, ledger=self._executor.ledger, poll_interval=keep_alive / 4)
            self._liveness = PeerLiveness(node_host(job), on_dead=self._watch.declare_dead)
            torch_private.bind_shared_store(handler, tcp_store_on)
        # Two agents see a join up to one membership read and a monitor pass or two apart.
        skew = (self._watch.poll_interval if self._watch else 0.0) + 2 * job.job.monitor_interval
        # In-process, a joining node heals from its peers' memory: a join throws nothing away, and waits for nothing.
        self._machine = RecoveryMachine(self._remaining_restarts, watches_membership=self._watch is not None,
                                        join_wait_s=0.0 if job.elastic.in_process else job.elastic.join_wait,
                                        detection_skew_s=skew)
        # Where the node's local rank 0 tells of each commit (agent.commit_notice); the agent's own.
        self._notice_dir = Path(tempfile.mkdtemp(prefix="torchrevive-agent-"))
        self._commit_notice = self._notice_dir / "commit_notice.json"
        # Where survivors' workers re-form rounds in-process with this agent (agent.regroup).
        self._regroup_dir = self._notice_dir / "regroup" if job.elastic.in_process else None
        if self._regroup_dir is not None:
            self._regroup_dir.mkdir()
        self._regroup_pending = False
        """The workers left the round alive: the next round is handed to them, not started anew."""
        self._leaving: tuple[int, float] | None = None
        """(round, monotonic time): the workers were asked to leave that round then."""
        self._nobody_lost = False
        """The change the workers were last asked to leave for was a join seen by this agent itself
        (sharded state heals from their memory only when nobody was lost)."""
        self._heals_from_memory = False
        """The workers left the last round holding a step their training function heals the next
        from (no snapshot is read: none is prefetched)."""
        self._regroup_due: tuple[int, float] | None = None
        """(round, monotonic deadline): the round handed over, by when its workers must have taken it."""
        self._regroup_failed: str | None = None
        """Why the workers did not take the round handed to them: the next round restarts them."""
        self._wrap_next_rendezvous(handler)
        node = self._watch.node if self._watch else f"{job.launch.local_addr or 'node'}_{os.getpid()}"
        self.events = EventLog(job.observability.event_log, node=node)
        self._metrics = Metrics.serve(job.observability.metrics_addr, job.observability.metrics_port)
        # Started before the first rendezvous (which may be long), as torch's newer launcher does.
        server = health.from_environment(torch_private.alive_time(self), host=job.observability.metrics_addr)
        if server is not None:
            torch_private.set_health_check_server(self, server)
        self._prefetch_stop = threading.Event()
        self._memory = memory_tier(job, handler.get_run_id())
        self._memory_buddy = ""
        self._restore_source = "storage"
        self._compile_cache = CompileCache(job.compile.cache_dir, job.checkpoint.dir, share=job.compile.share,
                                           served=self._memory.root if self._memory else None) \
            if job.compile.cache_dir else None
        self._warm = self._start_warm_process() if job.launch.warm_workers else None
        self._shared_commit: float | None = None
        """The time of the last commit after which this node's compile caches were offered for sharing."""
        # Prefetch reads manifests through torchsnapshot (with DTensor and DCP: seconds of CPU on a
        # busy node). Loaded beside the first rendezvous: not before it, which would delay a
        # joining node, nor when the first workers start, which would slow them down.
        threading.Thread(target=importlib.import_module, args=("agent.prefetch",), name="torchrevive-preload",
                         daemon=True).start()

    def worker_environment(self) -> dict[str, str]:
        """The variables for the round about to start: TORCHREVIVE_*, and inductor's cache directory
        with ``compile.cache_dir``."""
        job = self._job
        return {
            worker.CONFIG: self._config_path,
            worker.CHECKPOINT_DIR: job.checkpoint.dir or "",
            worker.EVENT_LOG: job.observability.event_log or "",
            worker.PREV_WORLD_SIZE: str(self._prev_world_size or ""),
            worker.RESTORE_FROM: self._restore_from,
            worker.GRAD_ACCUM_STEPS: str(self._grad_accum_steps),
            worker.ROUND: "" if self._round is None else str(self._round),
            worker.MEMORY_DIR: str(self._memory.root) if self._memory else "",
            worker.MEMORY_BUDDY: self._memory_buddy,
            worker.COMMIT_NOTICE: str(self._commit_notice),
            worker.REGROUP_DIR: str(self._regroup_dir or ""),
            worker.PROCESS_GROUP_TIMEOUT: repr(float(job.elastic.process_group_timeout)),
            **(self._compile_cache.environment() if self._compile_cache else {}),
        }

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """torch's run; when the agent ends, it stops watching the membership, says goodbye to the
        agents watching it (it left, it did not die), the node's memory snapshots are dropped (the job succeeded or failed
        for good: storage holds what outlives it), and the metrics endpoint closes."""
        try:
            return super().run(role)
        finally:
            if self._watch is not None:
                self._watch.close()
            if self._liveness is not None:
                self._liveness.close()
            if self._memory is not None:
                self._memory.close()
            if self._warm is not None:
                self._warm.close()
            self._metrics.close()
            shutil.rmtree(self._notice_dir, ignore_errors=True)

    # -- the monitor loop ----------------------------------------------------------------------

    @property
    def _remaining_restarts(self) -> int:
        return self._machine.remaining_restarts

    @_remaining_restarts.setter
    def _remaining_restarts(self, value: int) -> None:
        # torch's agent sets it in its __init__, before this agent knows whether it watches the
        # membership: the machine is made again then.
        machine = self.__dict__.get("_machine")
        if machine is None:
            self._machine = RecoveryMachine(value, watches_membership=False)
        else:
            machine.remaining_restarts = value

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Monitor the workers and the membership; carry out what the recovery machine decides."""
        spec = self._worker_group.spec
        self._initialize_workers(self._worker_group)
        while True:
            time.sleep(spec.monitor_interval)
            result = self._monitor_workers(self._worker_group)
            state = self._worker_group.state = result.state
            self._metrics.set_remaining_restarts(self._remaining_restarts)
            change = None if state == WorkerState.SUCCEEDED else self._membership_change(state == WorkerState.HEALTHY)
            # The notice matters only to a join, seen now or waiting: no read on every other pass.
            commit = read_notice(self._commit_notice) if change is not None or self._machine.deferring else None
            action = self._machine.observe(state, change, now=time.time(), commit=commit)
            if isinstance(action, DeferJoin):
                self.events.record("join_deferred", joined=sorted(action.change.joined), due_in_s=action.due - time.time(),
                                   until_s=action.until - time.time())
            if isinstance(action, ConfirmLoss):
                action = self._machine.loss_confirmed(self._loss_behind_failure(), now=time.time())
            if isinstance(action, Finish):
                if action.announce:
                    self._announce_success()
                self._exit_barrier()
                return result
            if isinstance(action, Fail):
                self._stop_workers(self._worker_group)
                self._worker_group.state = WorkerState.FAILED
                return result
            if isinstance(action, Recover):
                self._recover(action)
            elif state == WorkerState.HEALTHY:
                self._share_compile_cache()

    def _announce_success(self) -> None:
        """Tell standby nodes the job is over: they join the exit barrier. The workers succeeded
        whatever the store answers: one it cannot reach (an etcd that is not back yet) is an
        event, never a failure of the job."""
        try:
            self._worker_group.store.set(JOB_SUCCEEDED_KEY, "1")
        except (RendezvousError, dist.DistError) as exc:
            self.events.record("success_unannounced", problem=f"{type(exc).__name__}: {exc}")
            logger.warning("the job succeeded, but the rendezvous store could not record it (%s: %s): standby "
                           "nodes were not told", type(exc).__name__, exc)

    def _share_compile_cache(self) -> None:
        """(The round's leader, with ``compile.share``.) After each storage commit its workers
        tell of, offer this node's compile caches to the checkpoint directory."""
        if self._compile_cache is None or self._compile_cache.shared is None or self._worker_group.group_rank != 0 \
                or self._standby:
            return
        notice = read_notice(self._commit_notice)
        if notice is None or notice.tier != "storage" or notice.at == self._shared_commit:
            return
        self._shared_commit = notice.at

        def shared(result: Shared | None, problem: str | None) -> None:
            self.events.record("compile_cache_shared", step=notice.step, problem=problem,
                               **(asdict(result) if result else {}))

        self._compile_cache.share_if_changed(shared)

    def _membership_change(self, workers_healthy: bool) -> Change | None:
        if self._watch is not None:
            return self._watch.check(workers_healthy=workers_healthy, now=not workers_healthy)
        waiting = self._worker_group.spec.rdzv_handler.num_nodes_waiting()
        return Change("node_joined") if workers_healthy and waiting > 0 else None

    def _loss_behind_failure(self) -> Change | None:
        """Workers failed with no restart left: when a peer node died, they failed because of it.
        Its heartbeats lapse within ``keep_alive_interval`` x ``keep_alive_max_attempt``: watch that
        long for it. (With a restart left, the next rendezvous tells, and the restart is refunded.)"""
        assert self._watch is not None, "the recovery machine confirms a loss only when it watches the membership"
        deadline = time.monotonic() + self._watch.heartbeat_timeout + 1
        while time.monotonic() < deadline:
            change = self._watch.check(workers_healthy=False)
            if change is not None:
                return change
            time.sleep(0.2)
        return None

    def _recover(self, action: Recover) -> None:
        """Stop the workers at once, then rendezvous and start the next round."""
        detected, change = time.time(), action.change
        self.events.record("membership_change", cause=change.cause, lost=sorted(change.lost),
                           joined=sorted(change.joined), failed_at=change.failed_at or detected,
                           workers_blocked=change.workers_blocked, by_connection=change.by_connection,
                           world_size=self._prev_world_size, deferred_s=action.deferred_s, at_commit=action.at_commit)
        self._metrics.count_recovery(change.cause)
        self._prefetch_stop.set()
        self._pull_ahead()
        started = time.monotonic()
        fallback = self._leave_in_process(change) if self._regroup_dir is not None else None
        # In-process, the workers leave while the rendezvous runs: the next round is handed to them
        # once they did (_start_workers), and this node is in that round even when one is late.
        self._regroup_pending = fallback == ""
        if not self._regroup_pending:
            if fallback:
                self.events.record("in_process_fallback", reason=fallback)
            self._stop_workers(self._worker_group)
            self.events.record("workers_stopped", seconds=time.monotonic() - started, path="restart")
        self._worker_group.state = WorkerState.STOPPED
        self._machine.workers_stopped()
        self._initialize_workers(self._worker_group)

    def _pull_ahead(self) -> None:
        """With the memory tier, start pulling the newest memory snapshot's files this node's ranks
        lack from the live peers, while the workers stop and the rendezvous runs: whatever ended
        the round, the next one restores that snapshot when it is whole and newest."""
        group = self._worker_group
        if self._memory is None or self._round is None or self._standby or not group.workers:
            return

        def pulled(snapshot: MemorySnapshot | None, nbytes: int, seconds: float) -> None:
            self.events.record("memory_pull_ahead_done", snapshot=snapshot.relative if snapshot else None,
                               step=snapshot.step if snapshot else None, bytes=nbytes, seconds=seconds)

        self._memory.pull_ahead(group.store, self._round, group.group_rank, self._nodes_used,
                                [w.global_rank for w in group.workers], group.workers[0].world_size, pulled)

    def _leave_in_process(self, change: Change) -> str:
        """Ask this node's workers to leave the round (for a ``change`` that loses nobody, at the
        end of the step in flight if it ends within half of ``elastic.in_process_deadline``: a step
        cut short is work thrown away): "" when asked, else why the round takes the restart path
        here."""
        group, directory = self._worker_group, self._regroup_dir
        assert directory is not None and self._round is not None, "in-process rounds need a rendezvous round"
        if self._standby or not group.workers:
            return "this node ran no workers"
        if self._pcontext is None or self._pcontext.wait(0) is not None:
            return "a worker process ended"
        if self._regroup_failed is not None:
            failed, self._regroup_failed = self._regroup_failed, None
            return failed
        regroup.request_leave(directory, self._round,
                              finish_step_s=self._job.elastic.in_process_deadline / 2 if change.loses_nobody else 0.0)
        # Seen directly: a peer that moved the round on for a join may have lost a worker too.
        self._nobody_lost = change.only_joins and (self._leaving is None or self._nobody_lost)
        self._leaving = (self._round, time.monotonic())
        return ""

    def _await_left(self) -> str:
        """Wait, up to ``elastic.in_process_deadline`` from the request, until each of this node's
        workers says it left the round: "" when all did (or none was asked: a rehearsal's said
        so already), else why they are restarted instead."""
        assert self._pcontext is not None, "the workers run"
        self._heals_from_memory = False
        if self._leaving is None:
            return ""
        (round, asked), self._leaving = self._leaving, None
        deadline = asked + self._job.elastic.in_process_deadline
        while True:
            left = self._workers_left(round)
            late = [w.local_rank for w in self._worker_group.workers if w.local_rank not in left]
            if not late:
                self._heals_from_memory = all(said.healed and said.step is not None
                                              and (not said.sharded or self._nobody_lost) for said in left.values())
                self.events.record("workers_stopped", seconds=time.monotonic() - asked, path="in_process",
                                   reasons=sorted({said.reason for said in left.values()}))
                return ""
            if self._pcontext.wait(0) is not None:
                return "a worker process ended while it left the round"
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        return self._late(late, f"leave round {round}")

    def _late(self, local_ranks: list[int], missed: str) -> str:
        """Have each of ``local_ranks``, late to do what ``missed`` says, write its threads' stacks
        to its stderr before it is stopped (``run_resilient`` registers faulthandler for
        regroup.STACK_DUMP_SIGNAL); why they are restarted."""
        assert self._pcontext is not None, "the workers run"
        for local_rank, pid in self._pcontext.pids().items():
            if local_rank in local_ranks:
                try:
                    os.kill(pid, regroup.STACK_DUMP_SIGNAL)
                except OSError:  # it ended meanwhile
                    pass
        time.sleep(regroup.STACK_DUMP_WAIT_S)
        return (f"local ranks {local_ranks} did not {missed} within elastic.in_process_deadline "
                f"({self._job.elastic.in_process_deadline:g} s); their threads' stacks are in their logs")

    def _workers_left(self, round: int | None = None) -> dict[int, regroup.Left]:
        """What each of this node's workers that left ``round`` (by default the current one) said,
        by local rank."""
        assert self._regroup_dir is not None
        round = self._round if round is None else round
        if round is None:  # no rendezvous round: no worker can have left one
            return {}
        return regroup.left_round(self._regroup_dir, [w.local_rank for w in self._worker_group.workers], round)

    def _workers_late_to_regroup(self) -> list[int]:
        """The local ranks that did not take the round handed to them in time (their stacks then
        go to their logs, and the next round restarts them); [] while there is time, or all did."""
        if self._regroup_due is None:
            return []
        assert self._regroup_dir is not None
        round, due = self._regroup_due
        ranks = [w.local_rank for w in self._worker_group.workers]
        late = [rank for rank in ranks if rank not in regroup.took_round(self._regroup_dir, ranks, round)]
        if late and time.monotonic() < due:
            return []
        self._regroup_due = None
        if not late:
            return []
        self._regroup_failed = self._late(late, f"take round {round}")
        return late

    @staticmethod
    def _in_process_failure(worker: Worker, message: str) -> ProcessFailure:
        """A live worker's failure in an in-process round, as torch reports a failed process."""
        failure = ProcessFailure(local_rank=worker.local_rank, pid=worker.id or 0, exitcode=1, error_file="")
        failure.message = message
        return failure

    def _round_environments(self, worker_group: WorkerGroup) -> dict[int, dict[str, str]]:
        """This round's environment for each worker that left the last round, by local rank."""
        spec = worker_group.spec
        common = {**self.worker_environment(), "GROUP_RANK": str(worker_group.group_rank),
                  "GROUP_WORLD_SIZE": str(worker_group.group_world_size), "MASTER_ADDR": worker_group.master_addr,
                  "MASTER_PORT": str(worker_group.master_port), "LOCAL_WORLD_SIZE": str(spec.local_world_size),
                  "TORCHELASTIC_RESTART_COUNT": str(spec.max_restarts - self._remaining_restarts)}
        return {w.local_rank: {**common, "RANK": str(w.global_rank), "ROLE_RANK": str(w.role_rank),
                               "WORLD_SIZE": str(w.world_size), "ROLE_WORLD_SIZE": str(w.role_world_size)}
                for w in worker_group.workers}

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if not self._standby:
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.HEALTHY and self._regroup_dir is not None:
                # A worker left on its own: a collective failed, a peer is gone (or failed).
                left = self._workers_left()
                if left:
                    return RunResult(state=WorkerState.FAILED, failures={
                        w.global_rank: self._in_process_failure(
                            w, f"left round {self._round} in-process: {left[w.local_rank].reason}")
                        for w in worker_group.workers if w.local_rank in left})
                late = self._workers_late_to_regroup()
                if late:
                    assert self._regroup_failed is not None
                    return RunResult(state=WorkerState.FAILED, failures={
                        w.global_rank: self._in_process_failure(w, self._regroup_failed)
                        for w in worker_group.workers if w.local_rank in late})
            return result
        finished = worker_group.store.check([JOB_SUCCEEDED_KEY])
        return RunResult(state=WorkerState.SUCCEEDED if finished else WorkerState.HEALTHY)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # torch's default gives workers 30 s after SIGTERM; a worker blocked in a collective
        # with a dead peer never exits by itself, so the grace period is the job's. The health
        # check keeps answering while the job re-forms (torch's _shutdown would stop it).
        with torch_private.health_check_server_kept(self):
            self._shutdown(signal.SIGTERM, timeout=math.ceil(self._job.elastic.stop_grace))

    def _setup_healthcheck(self) -> None:
        """Nothing: the health-check server started with the agent serves through every round
        (torch's would replace it with a new one each time workers start)."""

    # -- one round -------------------------------------------------------------------------------

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """torch's (rendezvous, then start the workers); then, while the workers start, delete
        the previous round's keys when this node is the one to (:mod:`agent.rendezvous.round_keys`)."""
        super()._initialize_workers(worker_group)
        finished, self._keys_to_delete = self._keys_to_delete, None
        if finished is None or self._executor is None:
            return
        try:
            delete_keys(worker_group.spec.rdzv_handler, self._executor.acks, finished)
        except Exception as exc:  # noqa: BLE001 - a cleanup (etcd may refuse it): training goes on
            self.events.record("round_keys_kept", round=finished.round, error=str(exc))

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous and the round's hand-offs. A node that the rendezvous moved on
        without while it read the round's keys (it was frozen, say: the next round deletes them)
        joins the next round instead of failing; so does a leader that finds the checkpoint dir's
        fence past its round (StaleRoundError) once the rendezvous moved on too."""
        while True:
            try:
                return self._join_round(worker_group)
            except (RoundLeftBehind, StaleRoundError, dist.DistStoreError, LookupError) as exc:
                if not isinstance(exc, RoundLeftBehind) and not self._left_behind():
                    raise
                self.events.record("round_left_behind", error=str(exc))

    def _round_broken(self) -> str | None:
        """Why the round this node last joined cannot start, if it cannot: the rendezvous moved on
        without this node, or a participant died after the round completed (its heartbeats lapsed,
        or its agent's connection closed). The keys the round's agents were to set never come."""
        if self._left_behind():  # its sync also feeds the ledger
            return "the rendezvous round moved on without this node"
        if self._executor is None:
            return None
        dead = sorted(node for node in self._round_nodes if self._executor.ledger.is_dead(node))
        return f"participant {', '.join(dead)} of the round died after it completed" if dead else None

    def _assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int,
                             spec: WorkerSpec) -> list[Worker]:
        """torch's assignment of worker ranks, once the keys it reads are set (each node's role, on
        the round's first node; the ranks that node assigned, on the others). torch reads them with
        blocking calls, which waited out the store's timeout (60 s) when a participant died between
        the round's completion and its write; this wait gives up as soon as the round is broken."""
        assignment = torch_private.rank_assignment_keys(spec, group_rank, group_world_size)
        if assignment is not None:
            own_key, own_role, read = assignment
            store.set(own_key, own_role)
            round_values.wait_for_keys(store, read, self._round_broken)
        return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)

    def _left_behind(self) -> bool:
        """Whether the rendezvous is past the round this node last joined (with or without it)."""
        completed = self._executor.completed_round if self._executor is not None else None
        if completed is None:
            return False
        try:
            with torch_private.synced_state(self._worker_group.spec.rdzv_handler) as holder:
                return holder.state.round != completed
        except RendezvousError:  # unreachable, or worse: the caller's own error tells
            return False

    def _note_round(self, round: int, participants: frozenset[str]) -> None:
        """Remember this round for the deletion of its keys; the previous one's go after this
        round's workers start when this node is the one to delete them."""
        finished, self._finished_round = self._finished_round, FinishedRound(round, participants)
        if finished is not None and finished.round != round and self._watch is not None \
                and finished.deleted_by(participants) == self._watch.node:
            self._keys_to_delete = finished

    def _join_round(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        super()._rendezvous(worker_group)
        store = worker_group.store
        assert store is not None, "the rendezvous sets the round's store"
        if worker_group.spec.rdzv_handler.use_agent_store:
            self._serve_fresh_worker_store(worker_group)
        world_size = worker_group.workers[0].world_size if worker_group.workers else 0
        if not self._standby:
            self._grad_accum_steps = grad_accum_steps(self._job, world_size)
        completed = self._executor.completed_round if self._executor is not None else None
        membership = self._watch.start_round(completed) if self._watch else None
        self._round = membership.round if membership else None
        if membership is not None:
            self._note_round(membership.round, membership.participants)
        if self._liveness is not None and membership is not None:
            self._liveness.start_round(store, self._watch.node, sorted(membership.participants))
        if self._memory is not None and self._round is not None:
            self._memory_buddy = self._memory.start_round(store, self._round, worker_group.group_rank, self._nodes_used)
        self._restore_from = self._agree_on_snapshot(worker_group)
        participants = membership.participants if membership else frozenset()
        # A restart counted for the last failure is refunded when the membership changed: the
        # workers failed because a peer node was lost, or a peer's stopped for a joining node.
        outcome = self._machine.round_formed(participants, standby=self._standby)
        self._metrics.set_world_size(world_size)
        self.events.record(
            "rendezvous_done", seconds=time.monotonic() - started, round=membership.round if membership else None,
            group_rank=worker_group.group_rank, nodes=sorted(participants), lost=sorted(outcome.lost),
            joined=sorted(outcome.joined) if self._prev_world_size else [], world_size=world_size,
            prev_world_size=self._prev_world_size, grad_accum_steps=self._grad_accum_steps,
            restore_from=self._restore_from or None, standby=self._standby,
        )

    def _serve_fresh_worker_store(self, worker_group: WorkerGroup) -> None:
        """Point this round's workers at a new, empty TCPStore hosted by the round's leader agent.

        torch's c10d rendezvous shares one TCPStore with the workers of every round, and the keys
        a process group writes there (peer addresses) outlive the round: after a restart, new
        workers read dead peers' addresses and gloo/NCCL init fails or hangs until its timeout.
        """
        store = worker_group.store
        if worker_group.group_rank == 0:
            self._worker_store = tcp_store_on(worker_group.master_addr)
            store.set(WORKER_STORE_KEY, f"{worker_group.master_addr} {self._worker_store.port}")
        published = round_values.wait_for_value(store, WORKER_STORE_KEY, self._round_broken)
        worker_group.master_addr, worker_group.master_port = round_values.worker_store_address(WORKER_STORE_KEY,
                                                                                               published)

    def _agree_on_snapshot(self, worker_group: WorkerGroup) -> str:
        """The round's leader records the round as the checkpoint dir's fencing token (a save of
        an older round can no longer commit) and picks the latest committed snapshot: the memory
        tier's when the live nodes hold a newer (or the same) step, else storage's. Every node
        reads its choice, checked (:mod:`agent.rendezvous.round_values`): a snapshot's name,
        resolved under its own checkpoint dir or memory directory; for a memory snapshot, it starts
        pulling the files its ranks lack."""
        directory = self._job.checkpoint.dir
        store = worker_group.store
        if worker_group.group_rank == 0:
            if directory and self._round is not None:
                if self._round == 0 and self._left_behind():
                    # Round 0 replaces the fence as a new run of the job; not when it is a stale leader's.
                    raise RoundLeftBehind(f"round 0 ended before its leader wrote the fence in {directory}")
                write_fence(Path(directory), self._round)
            committed = committed_snapshots(Path(directory)) if directory else []
            chosen = committed[-1][1].name if committed else ""
            if self._memory is not None and self._round is not None:
                in_memory = self._memory.choose(store, self._round, self._nodes_used)
                if in_memory is not None and (not committed or in_memory.snapshot.step >= committed[-1][0]):
                    chosen = MEMORY_CHOICE + in_memory.to_json()
            store.set(RESTORE_FROM_KEY, chosen)
        chosen = round_values.wait_for_value(store, RESTORE_FROM_KEY, self._round_broken)
        self._restore_source = "memory" if chosen.startswith(MEMORY_CHOICE) else "storage"
        if self._restore_source == "storage":
            path = round_values.storage_choice(RESTORE_FROM_KEY, chosen, directory)
            return "" if path is None else str(path)
        choice, local_path = round_values.memory_choice(RESTORE_FROM_KEY, chosen,
                                                        self._memory.root if self._memory else None)
        local = str(local_path)
        assert self._memory is not None and self._round is not None, "a memory tier runs rounds"
        if self._standby:
            return local

        def fetched(pulled: int, seconds: float) -> None:
            self.events.record("memory_fetch_done", snapshot=local, step=choice.snapshot.step, bytes=pulled,
                               seconds=seconds)

        ranks = [w.global_rank for w in worker_group.workers]
        self._memory.start_fetch(store, self._round, choice, ranks, worker_group.workers[0].world_size, fetched)
        return local

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._regroup_due = None
        if self._regroup_pending:
            self._regroup_pending = False
            if self._standby:
                problem = "this node stands by in the new round"
            elif len(worker_group.workers) != self._nproc_per_node or self._pcontext is None \
                    or self._pcontext.wait(0) is not None:
                problem = "a worker process ended while the round re-formed"
            else:
                problem = self._await_left()
            if not problem:
                started = time.monotonic()
                directory, round = self._regroup_dir, self._round
                assert directory is not None and round is not None, "in-process rounds need a rendezvous round"
                environments = self._round_environments(worker_group)
                # Recorded before the hand-over: a worker goes on as soon as it reads its own.
                self.events.record("workers_started", seconds=time.monotonic() - started,
                                   ranks=[w.global_rank for w in worker_group.workers], start="in_process")
                for local_rank, environment in environments.items():
                    regroup.hand_over(directory, local_rank, round, environment)
                self._regroup_due = (round, time.monotonic() + self._job.elastic.in_process_deadline)
                pids = self._pcontext.pids()
                self._prev_world_size = worker_group.workers[0].world_size
                if not self._heals_from_memory:
                    self._prefetch_restore(worker_group)
                return pids
            self._leaving = None
            self.events.record("in_process_fallback", reason=problem)
            self._stop_workers(worker_group)
        if self._standby:
            self.events.record("standby", nodes_used=self._nodes_used)
            return {}
        started = time.monotonic()
        pids, spawn_reason = self._spawn_workers(worker_group, self.worker_environment())
        self.events.record("workers_started", seconds=time.monotonic() - started,
                           ranks=[w.global_rank for w in worker_group.workers],
                           start="spawn" if spawn_reason else "warm", spawn_reason=spawn_reason or None)
        self._prev_world_size = worker_group.workers[0].world_size
        self._prefetch_restore(worker_group)
        return pids

    def _prefetch_restore(self, worker_group: WorkerGroup) -> None:
        """Read this node's share of the storage snapshot the round restores into the page cache
        while its workers get ready (``restore.prefetch``)."""
        if self._restore_from and self._job.restore.prefetch and self._restore_source == "storage":
            self._start_prefetch(worker_group)

    def _spawn_workers(self, worker_group: WorkerGroup, environment: dict[str, str]) -> tuple[dict[int, Any], str]:
        """torch's start of the group's workers (forked from the warm process where it can be),
        with ``environment`` added to each; their pids, and why they were spawned ("": forked)."""
        handlers: list[WarmSubprocessHandler] = []

        def handler(**kwargs: Any) -> SpawnedSubprocessHandler:
            if self._warm is None:
                return SpawnedSubprocessHandler(**kwargs)
            handlers.append(WarmSubprocessHandler(self._warm, **kwargs))
            return handlers[-1]

        if self._compile_cache is not None:
            from_peer = self._compile_cache_from_peer if self._memory is not None else None
            self.events.record("compile_cache_ready", **asdict(self._compile_cache.prepare(from_peer)))
        if self._warm is not None:
            reap_orphans(keep={self._warm.pid})
        # The round's variables go into each worker's own environment: setting them in the
        # agent's (setenv) is unsafe while its threads (gRPC's, the stores') may read it.
        with torch_private.worker_environment_added(environment), torch_private.subprocess_handlers(handler):
            pids = super()._start_workers(worker_group)
        if self._warm is not None and ((self._warm.problem and not self._warm.refused)
                                       or any(h.environment_changed for h in handlers)):
            self._warm.close()  # gone, or made for another environment: a new one for the next round
            self._warm = self._start_warm_process()
        return pids, self._spawn_reason(handlers)

    def _compile_cache_from_peer(self, into: Path) -> None:
        """Copy a peer's shared compile caches into ``into`` over the memory tier's data plane: from
        another node of this node's round or, before its first (a joining node rehearsing), of the
        round under way."""
        assert self._memory is not None, "the data plane is the memory tier's"
        handler = self._worker_group.spec.rdzv_handler
        if not isinstance(handler, DynamicRendezvousHandler):
            raise CompileCacheError(f"peers are found through torch's dynamic rendezvous, not {type(handler).__name__}")
        round, exclude = self._round, self._worker_group.group_rank
        try:
            if round is None:
                with torch_private.synced_state(handler) as holder:
                    round, exclude = holder.state.round, None
            self._memory.from_peers(torch_private.rendezvous_store(handler), round,
                                    lambda client: fetch_shared(client.get, into), exclude=exclude)
        except (PeerError, RendezvousError, OSError, ValueError) as exc:
            raise CompileCacheError(str(exc)) from None

    def _rehearse_join(self) -> None:
        """Before a node joins a running job with in-process rounds, its workers rehearse
        (:mod:`agent.rehearsal`): the round with this node is then handed to them in-process.
        A rehearsal that fails, or cannot run, stops them: the node joins as without one."""
        group, directory = self._worker_group, self._regroup_dir
        handler = group.spec.rdzv_handler
        # Without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE) worker rank 0 would host one.
        if directory is None or not self._job.elastic.rehearse_joins or not handler.use_agent_store \
                or not rehearsal.joins_a_running_job(handler):
            return
        started, spawn_reason = time.monotonic(), ""
        try:
            # The rehearsal's store serves this node's workers alone; they have left their group
            # once they said they left it, and it goes with this call.
            store = group.store = tcp_store_on(rehearsal.LOOPBACK)
            rehearsal.rehearsal_workers(group, self._nproc_per_node, rehearsal.LOOPBACK, store.port)
            try:
                accum = grad_accum_steps(self._job, self._nproc_per_node)
            except ConfigError:  # no whole number at a world of this node alone: the warm-up's batch may differ
                accum = 1
            environment = {**self.worker_environment(), worker.ROUND: str(worker.REHEARSAL_ROUND),
                           worker.CHECKPOINT_DIR: "", worker.RESTORE_FROM: "", worker.MEMORY_DIR: "",
                           worker.MEMORY_BUDDY: "", worker.PREV_WORLD_SIZE: "", worker.GRAD_ACCUM_STEPS: str(accum)}
            _, spawn_reason = self._spawn_workers(group, environment)
            assert self._pcontext is not None, "torch's start sets the workers' context"
            problem = rehearsal.wait_rehearsed(directory, [w.local_rank for w in group.workers], self._pcontext,
                                               self._job.elastic.rehearsal_deadline)
        except Exception as exc:  # noqa: BLE001 - a rehearsal only saves time: the node joins without one
            problem = f"the rehearsal could not run: {exc}"
        finally:
            group.workers, group.store = [], None
        self._regroup_pending = not problem
        if problem:
            self._stop_workers(group)
        self.events.record("rehearsal_done", seconds=time.monotonic() - started, problem=problem or None,
                           start="spawn" if spawn_reason else "warm")

    def _start_warm_process(self) -> WarmProcess | None:
        """Become the workers' subreaper and start a warm process; None where workers cannot be
        forked from one (see :meth:`_spawn_reason`), with an event where the platform is why."""
        if self._spawned_by_design():
            return None
        try:
            become_subreaper()
        except OSError as exc:
            self.events.record("warm_process_unavailable", error=str(exc))
            return None
        keep_reaping_orphans()  # a subreaper adopts its workers' orphans: they are zombies until reaped
        warm = WarmProcess(self._job.launch.preload, os.environ)
        self.events.record("warm_process_started", pid=warm.pid, preload=warm.preload)
        return warm

    def _spawned_by_design(self) -> str:
        """Why this job's workers are never forked warm, or "": they do not run this Python (a
        function with --run-path, --no-python, another PYTHON_EXEC) or run under numactl."""
        spec = self._worker_group.spec
        if spec.entrypoint != sys.executable:
            return f"the workers' entrypoint {spec.entrypoint!r} is not this Python (--run-path, --no-python or PYTHON_EXEC)"
        if spec.numa_options is not None:
            return "workers run under numactl (--numa-binding)"
        return ""

    def _spawn_reason(self, handlers: list[WarmSubprocessHandler]) -> str:
        """Why this round's workers were spawned rather than forked warm ("" when all were warm)."""
        if self._warm is None:
            if not self._job.launch.warm_workers:
                return "warm workers are off (launch.warm_workers)"
            return self._spawned_by_design() or "no subreaper on this platform"
        return next((h.spawn_reason for h in handlers if h.spawn_reason), "")

    def _start_prefetch(self, worker_group: WorkerGroup) -> None:
        self._prefetch_stop = stop = threading.Event()
        snapshot = Path(self._restore_from)
        ranks = [w.global_rank for w in worker_group.workers]
        world_size = worker_group.workers[0].world_size

        def run() -> None:
            from agent.prefetch import node_share, prefetch

            started = time.monotonic()
            try:
                nbytes = prefetch(snapshot, node_share(snapshot, ranks, world_size), stop=stop)
                self.events.record("prefetch_done", snapshot=str(snapshot), bytes=nbytes,
                                   seconds=time.monotonic() - started, cancelled=stop.is_set())
            except (OSError, RestoreError) as exc:  # best effort: the restore reads what is not warm
                self.events.record("prefetch_done", snapshot=str(snapshot), bytes=0,
                                   seconds=time.monotonic() - started, error=str(exc))

        threading.Thread(target=run, name="torchrevive-prefetch", daemon=True).start()


    def _wrap_next_rendezvous(self, handler: Any) -> None:
        """Before this node's first rendezvous, wait for the warm process to be ready (a node joins
        once it can start workers at once); right after each, before torch assigns worker ranks:

        * from the first completed round on, this node completes rounds early (PromptOpExecutor);
        * rank 0 publishes MASTER_ADDR/MASTER_PORT in the round's store. torch 2.13's
          DynamicRendezvousHandler does so only in the first round a node is rank 0 in, and a node
          joining a later round waited for them 60 s and failed (found with a join);
        * nodes beyond the largest count whose world size is a multiple of
          ``elastic.world_size_multiple_of`` become standby for the round: they offer no workers
          (so torch's rank assignment leaves them out) and wait for the next change.
        """
        next_rendezvous = handler.next_rendezvous
        rendezvoused = False

        def next_rendezvous_then_roles() -> RendezvousInfo:
            nonlocal rendezvoused
            if self._watch is not None:
                self._watch.pause()  # the rendezvous uses the handler's state alone
            if self._warm is not None and not rendezvoused:
                # A joining node asks to join once it can start workers at once: the running
                # job trains on meanwhile instead of waiting for its imports after the round.
                # (In a later round the job waits for this node anyway: it joins at once.)
                self._warm.wait_ready()
            if not rendezvoused:
                self._rehearse_join()
            info = next_rendezvous()
            rendezvoused = True
            if isinstance(handler, DynamicRendezvousHandler):
                self._round_nodes = torch_private.round_participants(handler) - {torch_private.this_node(handler)}
            if self._executor is not None:
                self._executor.rejoining = True
            if info.rank == 0 and isinstance(handler, DynamicRendezvousHandler):
                bootstrap = info.bootstrap_store_info
                info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, bootstrap.master_addr)
                info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(bootstrap.master_port))
            self._nodes_used = nodes_used(info.world_size, self._nproc_per_node, self._job.elastic.world_size_multiple_of)
            self._standby = info.rank >= self._nodes_used
            self._worker_group.spec.local_world_size = 0 if self._standby else self._nproc_per_node
            return info

        handler.next_rendezvous = next_rendezvous_then_roles


def memory_tier(job: JobConfig, run_id: str) -> MemoryTier | None:
    """The agent's part of the memory tier for rendezvous run ``run_id``, when the job turns it on
    (and has a rendezvous round to fence it with: not the static backend)."""
    if not job.checkpoint.memory_interval_steps or job.rendezvous.backend == "static":
        return None
    return MemoryTier(Path(job.checkpoint.memory_dir or DEFAULT_BASE), run_id=run_id, host=node_host(job),
                      secret_file=job.checkpoint.memory_secret_file)


def node_host(job: JobConfig) -> str:
    """The address this node's agent serves its peers on: ``launch.local_addr``, else the hostname."""
    return job.launch.local_addr or socket.gethostname()


def tcp_store_on(host: str, port: int = 0) -> dist.TCPStore:
    """A TCPStore server listening on ``host`` alone (port 0: a free one). TCPStore itself listens
    on every interface whatever host it is given; from a socket bound here, it listens where asked.
    Raises OSError when the port is taken."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own: a restarted agent rebinds at once
    try:
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    port = listener.getsockname()[1]
    return dist.TCPStore(host_name=host, port=port, is_master=True, wait_for_workers=False, multi_tenant=True,
                         master_listen_fd=listener.detach())


def nodes_used(nodes: int, nproc_per_node: int, multiple_of: int) -> int:
    """How many of ``nodes`` train: the most whose world size is a multiple of ``multiple_of``
    (0 when none is: every node stands by until more join)."""
    return next((used for used in range(nodes, 0, -1) if used * nproc_per_node % multiple_of == 0), 0)


def grad_accum_steps(job: JobConfig, world_size: int) -> int:
    """Gradient accumulation steps that keep ``elastic.global_batch_size`` at this world size
    (1 when no global batch is configured); ConfigError when none does."""
    elastic = job.elastic
    if elastic.global_batch_size is None:
        return 1
    micro = elastic.micro_batch_size or 1
    per_step = micro * world_size
    if elastic.global_batch_size % per_step:
        raise ConfigError(f"elastic.global_batch_size {elastic.global_batch_size} is not a multiple of "
                          f"micro_batch_size {micro} x world size {world_size}; pick sizes that divide at every "
                          "world size the job's nnodes allow")
    return elastic.global_batch_size // per_step
