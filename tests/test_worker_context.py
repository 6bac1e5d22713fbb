"""The agent -> rank environment contract, read by WorkerContext.from_env."""

from __future__ import annotations

import pytest

from agent import WorkerContext


def test_reads_torchrun_and_torchrevive_variables():
    ctx = WorkerContext.from_env({
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job",
        "TORCHREVIVE_CHECKPOINT_DIR": "/ckpt", "TORCHREVIVE_RESTORE_FROM": "/ckpt/step_40",
        "TORCHREVIVE_PREV_WORLD_SIZE": "6", "TORCHREVIVE_GRAD_ACCUM_STEPS": "3",
        "TORCHREVIVE_EVENT_LOG": "/log/events.jsonl", "TORCHREVIVE_CONFIG": "/run/job.yaml",
    })
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size, ctx.group_rank) == (3, 1, 4, 2, 1)
    assert (ctx.restart_count, ctx.run_id) == (2, "job")
    assert (ctx.checkpoint_dir, ctx.restore_from, ctx.prev_world_size) == ("/ckpt", "/ckpt/step_40", 6)
    assert (ctx.grad_accum_steps, ctx.event_log, ctx.config_path) == (3, "/log/events.jsonl", "/run/job.yaml")


def test_outside_a_launcher_is_a_world_of_one():
    ctx = WorkerContext.from_env({"TORCHREVIVE_RESTORE_FROM": "", "TORCHREVIVE_PREV_WORLD_SIZE": ""})
    assert (ctx.rank, ctx.world_size, ctx.restore_from, ctx.prev_world_size, ctx.grad_accum_steps) == (0, 1, None, None, 1)


def test_garbage_names_the_variable():
    with pytest.raises(ValueError, match="WORLD_SIZE='four'"):
        WorkerContext.from_env({"WORLD_SIZE": "four"})
