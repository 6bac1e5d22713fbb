"""Run a function on N real processes joined in a gloo process group on 127.0.0.1."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import TCPStore


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    store = TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    fn(rank, world_size, *args)
    dist.barrier()
    # No teardown: gloo's destructors can abort (SIGABRT) when peers exit at the same moment.
    sys.stdout.flush()
    os._exit(0)


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; any rank's
    exception fails the caller, and so do ranks still running after ``timeout_s`` seconds (a hang
    fails the test instead of stalling the run). The ranks meet at a store this process holds,
    bound to a port the kernel chose: no port is picked, released and hoped for."""
    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    context = mp.start_processes(_entry, args=(world_size, store.port, fn, args), nprocs=world_size, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{world_size} ranks of {fn.__name__} still running after {timeout_s:.0f} s (a hang)")
