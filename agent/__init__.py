"""torchrevive's worker-side API.

>>> import agent
>>> ctx = agent.WorkerContext.from_env()
"""

from agent.worker import WorkerContext

__all__ = ["WorkerContext"]
