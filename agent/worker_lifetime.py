"""Workers die with their agent: the kernel SIGKILLs a process whose parent dies (Linux
``PR_SET_PDEATHSIG``), so a SIGKILLed agent leaves no worker behind holding its (GPU) memory or
blocking in a collective when the next agent's workers start.

The signal comes when the *parent* goes: a process sets it only once its parent is the agent
(a warm-forked worker waits until it is re-parented there), and then checks that the parent is
still the agent, which may have died before the call (the process is re-parented elsewhere then,
and ends itself). The kernel sends it when the parent *thread* exits: the agent starts workers
and its warm process from its main thread, which lives as long as the agent. This module imports
nothing heavy: the warm process uses it before it imports torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: a spawned worker calls it between fork and exec


def die_with(agent_pid: int, *, after_parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when ``agent_pid``, its parent, dies; end it now when
    the agent is already gone. ``after_parent``: the parent it has now and is about to lose (a
    warm-forked worker's middle process), waited out first (the signal would come on its exit)."""
    while after_parent is not None and os.getppid() == after_parent:
        time.sleep(0.0005)  # the middle process exits right after the fork
    if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != agent_pid:  # the agent died before the call: what the signal would have done
        os.kill(os.getpid(), signal.SIGKILL)


def dying_with_agent() -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen`` from the agent: the child dies with the agent.
    Runs between fork and exec, where only the forking thread exists: it calls into libc and
    ``os`` alone, nothing that takes a lock another thread of the agent could have held."""
    agent_pid = os.getpid()
    return lambda: die_with(agent_pid)
