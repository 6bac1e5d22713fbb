"""The restore engine: manifest -> plan -> reader. See :func:`agent.restore.engine.restore`."""
