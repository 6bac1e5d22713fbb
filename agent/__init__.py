"""torchrevive's worker-side API.

>>> import agent
>>> ctx = agent.WorkerContext.from_env()
>>> stats = agent.restore("/ckpt/step_100", {"model": model, "optim": optim})

Names load on first use: the recovery agent imports this package too, and must not pay for
torchsnapshot, DCP and DTensor before it joins the rendezvous.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The subpackage first: a later first import of it would rebind ``agent.restore`` to the module.
from agent import restore as _restore_engine_package  # noqa: F401

if TYPE_CHECKING:
    from collections.abc import Mapping

    from agent.checkpoint import Checkpointer, CheckpointError
    from agent.elastic_sampler import ElasticSampler, batches_across_epochs
    from agent.errors import RestoreError
    from agent.restore.dcp_reader import FastStorageReader
    from agent.restore.engine import RestoreStats
    from agent.resilient import Round, RoundEnded, run_resilient
    from agent.worker import WorkerContext

_HOMES = {
    "Checkpointer": "agent.checkpoint.checkpointer",
    "CheckpointError": "agent.checkpoint.checkpointer",
    "ElasticSampler": "agent.elastic_sampler",
    "FastStorageReader": "agent.restore.dcp_reader",
    "RestoreError": "agent.errors",
    "RestoreStats": "agent.restore.engine",
    "Round": "agent.resilient",
    "RoundEnded": "agent.resilient",
    "run_resilient": "agent.resilient",
    "WorkerContext": "agent.worker",
    "batches_across_epochs": "agent.elastic_sampler",
}

__all__ = ["CheckpointError", "Checkpointer", "ElasticSampler", "FastStorageReader", "RestoreError", "RestoreStats",
           "Round", "RoundEnded", "WorkerContext", "batches_across_epochs", "restore", "run_resilient"]


def restore(path: str | Path, app_state: Mapping[str, Any], **options: Any) -> RestoreStats:
    """Restore a snapshot (or a DCP checkpoint) into ``app_state``, resharded to this process
    group; ``options`` and errors as for :func:`agent.restore.engine.restore`."""
    from agent.restore.engine import restore as restore_snapshot

    return restore_snapshot(path, app_state, **options)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'agent' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
