"""The sizes the agent derives for a round: gradient accumulation steps and the nodes that train."""

from __future__ import annotations

import pytest

from agent.config import ConfigError, JobConfig
from agent.recovery_agent import grad_accum_steps


def job(global_batch: int | None, micro: int | None) -> JobConfig:
    config = JobConfig()
    config.elastic.global_batch_size, config.elastic.micro_batch_size = global_batch, micro
    return config


def test_the_global_batch_is_kept_across_world_sizes():
    assert [grad_accum_steps(job(96, 4), world) for world in (1, 2, 3, 4, 6, 8)] == [24, 12, 8, 6, 4, 3]
    assert grad_accum_steps(job(None, None), 5) == 1


def test_a_world_size_that_cannot_keep_the_global_batch_is_an_error():
    with pytest.raises(ConfigError, match="elastic.global_batch_size 96 is not a multiple of micro_batch_size 4 x "
                                          "world size 5"):
        grad_accum_steps(job(96, 4), 5)


def test_nodes_used_keep_the_world_size_a_multiple():
    from agent.recovery_agent import nodes_used

    assert [nodes_used(n, 1, 2) for n in (1, 2, 3, 4, 5)] == [0, 2, 2, 4, 4]
    assert [nodes_used(n, 4, 8) for n in (1, 2, 3)] == [0, 2, 2]
    assert nodes_used(3, 2, 1) == 3
