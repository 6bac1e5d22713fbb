"""torchrevive's worker-side API.

>>> import agent
>>> ctx = agent.WorkerContext.from_env()
>>> stats = agent.restore("/ckpt/step_100", {"model": model, "optim": optim})

Names load on first use, so that importing a submodule (torch loads the etcd3 rendezvous backend
through an entry point in every process that imports torch.distributed.elastic) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Checkpointer": "agent.checkpoint",
    "CheckpointError": "agent.checkpoint",
    "ElasticSampler": "agent.elastic_sampler",
    "RestoreError": "agent.errors",
    "RestoreStats": "agent.restore",
    "restore": "agent.restore",
    "WorkerContext": "agent.worker",
}
__all__ = ["CheckpointError", "Checkpointer", "ElasticSampler", "RestoreError", "RestoreStats", "WorkerContext", "restore"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'agent' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
