"""How an example worker process starts (its device) and ends (the exit status of
``main``, without destructors)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import torch

import agent


def local_device(ctx: agent.WorkerContext) -> torch.device:
    """This rank's device: its local GPU (made current), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", ctx.local_rank)
    torch.cuda.set_device(device)
    return device


def run_then_exit(main: Callable[[], None]) -> NoReturn:
    """Run ``main`` (decorated with torch's ``@record``, which writes the error file for the agent
    when it raises) and end the process with 0, or 1 after printing the traceback.

    The process group is left alive and the process ends without destructors: torch 2.13's gloo
    process group can deadlock in its destructor when DDP's reducer drops the last reference to it
    (a worker thread finishing a collective waits for the GIL that the destructor holds), and the
    agent would then wait on this worker forever."""
    try:
        main()
    except BaseException:
        traceback.print_exc()
        exit_code = 1
    else:
        exit_code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
