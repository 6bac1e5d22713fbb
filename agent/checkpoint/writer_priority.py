"""How low the threads that write snapshots in the background run, so that training keeps the CPU
(see :mod:`agent.checkpoint.write`); light enough for the configuration to check a value."""

from __future__ import annotations

import os
import threading
from typing import Literal

WriterPriority = int | Literal["idle"]
"""How low the threads that write snapshots in the background run: ``"idle"`` (Linux's SCHED_IDLE
policy: they run only on CPU time no other thread wants) or a niceness, 0 (training's) to 19."""
_IDLE = 20
"""SCHED_IDLE, ranked below every niceness."""
_thread_priority = threading.local()


def check_writer_priority(priority: WriterPriority) -> str | None:
    """What is wrong with ``priority`` as a :data:`WriterPriority`, or None."""
    if priority == "idle" or (isinstance(priority, int) and not isinstance(priority, bool) and 0 <= priority <= 19):
        return None
    return f"{priority!r} is neither 'idle' nor a niceness from 0 to 19 (0: training's priority)"


def lower_thread_priority(priority: WriterPriority) -> None:
    """Run the calling thread (and the threads it starts later) at ``priority`` (niceness 0: leave
    it). Idempotent per thread; a priority the process is not allowed to take is left as it is."""
    rank = _IDLE if priority == "idle" else int(priority)
    if rank <= 0 or getattr(_thread_priority, "rank", 0) >= rank:
        return
    try:
        if priority == "idle":
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), rank)
    except OSError:  # below the process's own niceness without CAP_SYS_NICE: keep that one
        pass
    _thread_priority.rank = rank
