"""The restore engine: manifest -> plan -> reader. See :func:`restore`."""

from agent.restore.engine import RestoreStats, restore

__all__ = ["RestoreStats", "restore"]
