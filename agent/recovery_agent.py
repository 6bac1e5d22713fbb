"""The per-node recovery agent: torch.distributed.elastic's LocalElasticAgent, extended to hand
each round's torchrevive context to its workers."""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from agent import worker
from agent.config import JobConfig


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

    def worker_environment(self) -> dict[str, str]:
        """The TORCHREVIVE_* variables for the round about to start."""
        job = self._job
        return {
            worker.CONFIG: self._config_path,
            worker.CHECKPOINT_DIR: job.checkpoint.dir or "",
            worker.EVENT_LOG: job.observability.event_log or "",
            worker.PREV_WORLD_SIZE: str(self._prev_world_size or ""),
        }

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # Worker processes inherit the agent's environment, and LocalElasticAgent offers no other
        # hook for extra variables, so the round's values are set here, before they start.
        os.environ.update(self.worker_environment())
        pids = super()._start_workers(worker_group)
        self._prev_world_size = worker_group.workers[0].world_size
        return pids
