"""The save side: snapshots staged off the training thread, written by torchsnapshot, committed
atomically, checksummed, kept and pruned; one module per stage.

The Checkpointer (``agent.checkpoint.Checkpointer``) is the API. Names load on first use, so
that the agent can read the directory layout (``agent.checkpoint.dirs``) without torchsnapshot.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.checkpoint.checkpointer import Checkpointer, CheckpointError

__all__ = ["CheckpointError", "Checkpointer"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'agent.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module("agent.checkpoint.checkpointer"), name)
    globals()[name] = value
    return value
