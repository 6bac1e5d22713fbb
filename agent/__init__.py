"""torchrevive's worker-side API.

>>> import agent
>>> ctx = agent.WorkerContext.from_env()
>>> stats = agent.restore("/ckpt/step_100", {"model": model, "optim": optim})
"""

from agent.checkpoint import Checkpointer, CheckpointError
from agent.elastic_sampler import ElasticSampler
from agent.errors import RestoreError
from agent.restore import RestoreStats, restore
from agent.restore.dcp_reader import FastStorageReader
from agent.worker import WorkerContext

__all__ = ["CheckpointError", "Checkpointer", "ElasticSampler", "FastStorageReader", "RestoreError", "RestoreStats",
           "WorkerContext", "restore"]
