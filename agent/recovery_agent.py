"""The per-node recovery agent: torch.distributed.elastic's LocalElasticAgent, extended to give
each round's workers a fresh store and to hand them the round's torchrevive context."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from agent import worker
from agent.config import JobConfig

WORKER_STORE_PORT_KEY = "torchrevive/worker_store_port"


class RecoveryAgent(LocalElasticAgent):
    """A LocalElasticAgent that exports the TORCHREVIVE_* environment contract to its workers.

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

    def worker_environment(self) -> dict[str, str]:
        """The TORCHREVIVE_* variables for the round about to start."""
        job = self._job
        return {
            worker.CONFIG: self._config_path,
            worker.CHECKPOINT_DIR: job.checkpoint.dir or "",
            worker.EVENT_LOG: job.observability.event_log or "",
            worker.PREV_WORLD_SIZE: str(self._prev_world_size or ""),
        }

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        if worker_group.spec.rdzv_handler.use_agent_store:
            self._serve_fresh_worker_store(worker_group)

    def _serve_fresh_worker_store(self, worker_group: WorkerGroup) -> None:
        """Point this round's workers at a new, empty TCPStore hosted by the round's leader agent.

        torch's c10d rendezvous shares one TCPStore with the workers of every round, and the keys
        a process group writes there (peer addresses) outlive the round: after a restart, new
        workers read dead peers' addresses and gloo/NCCL init fails or hangs until its timeout.
        """
        store = worker_group.store
        assert store is not None, "the rendezvous sets the round's store"
        if worker_group.group_rank == 0:
            self._worker_store = dist.TCPStore(
                host_name=worker_group.master_addr, port=0, is_master=True, wait_for_workers=False
            )
            store.set(WORKER_STORE_PORT_KEY, str(self._worker_store.port))
        worker_group.master_port = int(store.get(WORKER_STORE_PORT_KEY))

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # Worker processes inherit the agent's environment, and LocalElasticAgent offers no other
        # hook for extra variables, so the round's values are set here, before they start.
        os.environ.update(self.worker_environment())
        pids = super()._start_workers(worker_group)
        self._prev_world_size = worker_group.workers[0].world_size
        return pids
