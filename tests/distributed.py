"""Run a function on N real processes joined in a gloo process group on 127.0.0.1."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    fn(rank, world_size, *args)
    dist.barrier()
    # No teardown: gloo's destructors can abort (SIGABRT) when peers exit at the same moment.
    sys.stdout.flush()
    os._exit(0)


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; any rank's
    exception fails the caller."""
    mp.spawn(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)
