"""The warm process: a Python interpreter that has already imported torch (and the modules the job
names in ``launch.preload``), from which the agent's workers are forked instead of started cold.

The agent starts it once (``python -u -c ...``, the interpreter and flags torchrun gives workers)
with a ``SOCK_SEQPACKET`` socket. It imports, checks that forking is still safe (no Python thread
but the main one, CUDA not initialized), says ready, and then serves one kind of request: start a worker with this
command line, environment, working directory and standard streams (passed as descriptors). For
each it forks twice: the middle process exits at once, so the worker is re-parented to the agent
(a child subreaper, :mod:`agent.warm_workers`) and is the agent's child as a spawned worker is.
The warm process replies with the worker's PID once that has happened. The warm process and each
worker die with the agent (:mod:`agent.worker_lifetime`); a worker does not die with the warm
process, which is not its parent.

The worker then becomes what ``python -u script.py args`` would be: a session of its own, that
command line as its process title, default signal handling, the streams on descriptors 0-2, the environment and directory it was given,
``sys.argv`` and ``sys.path[0]`` as Python sets them, fresh random seeds, and the script run as
``__main__``. Exceptions, ``sys.exit`` and interpreter shutdown (non-daemon threads, ``atexit``)
work as in a fresh interpreter.
"""

from __future__ import annotations

import builtins
import ctypes
import importlib
import io
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import types
from dataclasses import dataclass
from importlib.machinery import SourceFileLoader
from typing import Any

import setproctitle

from agent.worker_lifetime import die_with

MAX_MESSAGE = 1 << 20
"""The largest request (JSON: command line and environment) the warm process reads."""
_ARG_END_FIELD = 49
"""The field of /proc/PID/stat (numbered from 1) that holds where the command line ends."""


@dataclass(frozen=True)
class WorkerRequest:
    """What to run in a forked worker: ``python -u`` followed by ``target`` (a script path, or a
    module with ``module``), and ``args``."""

    argv: list[str]
    """The whole command line, as a spawned worker's would be (its process title)."""
    target: str
    module: bool
    args: list[str]
    env: dict[str, str]
    cwd: str


def main(fd: int, agent_pid: int, preload: list[str]) -> None:
    """The warm process's life: import ``preload``, serve requests on the socket ``fd``; returns
    only in a forked worker, after which the caller runs nothing but :func:`run_worker`. It and
    its workers die with the agent, ``agent_pid``."""
    die_with(agent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the agent, which stops the workers
    channel = socket.socket(fileno=fd)
    started = time.monotonic()
    try:
        for name in preload:
            importlib.import_module(name)
        problem = _fork_hazard()
    except Exception as exc:  # an import of the job's preload list failed: the agent spawns workers
        problem = f"importing the preload modules failed: {type(exc).__name__}: {exc}"
    if problem:
        channel.send(json.dumps({"error": problem, "lasting": True}).encode())
        return os._exit(0)
    channel.send(json.dumps({"ready": True, "seconds": time.monotonic() - started}).encode())
    request = _serve(channel, agent_pid)
    run_worker(request)


def _serve(channel: socket.socket, agent_pid: int) -> WorkerRequest:
    """Answer requests until the agent goes (then exit); return the request in a forked worker."""
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(channel, MAX_MESSAGE, 3)
        except OSError:
            os._exit(0)
        if not message:  # the agent closed its end
            os._exit(0)
        fields = json.loads(message)
        request = WorkerRequest(**fields)
        if _fork_worker(channel, fds, agent_pid):  # in the worker
            return request
        for fd in fds:
            os.close(fd)


def _fork_worker(channel: socket.socket, fds: list[int], agent_pid: int) -> bool:
    """Fork twice; in the worker, put ``fds`` on 0, 1, 2 and return True. In the warm process,
    reply with the worker's PID (once the middle process is gone) and return False."""
    hazard = _fork_hazard()
    if hazard:
        channel.send(json.dumps({"error": hazard, "lasting": True}).encode())
        return False
    pid_read, pid_write = os.pipe()
    middle = os.fork()
    if middle == 0 and _in_middle(pid_write, agent_pid):  # in the worker
        os.close(pid_read)
        os.close(pid_write)
        channel.close()
        _take_streams(fds)
        return True
    os.close(pid_write)
    with os.fdopen(pid_read, "rb") as pipe:
        answer = pipe.read()
    os.waitpid(middle, 0)  # gone: the worker is the agent's child now
    reply = {"pid": int(answer)} if answer else {"error": "the middle process failed to fork the worker"}
    channel.send(json.dumps(reply).encode())
    return False


def _in_middle(pid_write: int, agent_pid: int) -> bool:
    """In the middle process: fork the worker, then exit. The worker starts a session of its
    own and, once re-parented to the agent, dies with it; only then it hands its PID to the warm
    process (so that the agent, once it has the PID, can signal the worker's process group, and
    the worker cannot outlive it), and returns True."""
    middle = os.getpid()
    try:
        worker = os.fork()
    except BaseException:
        os._exit(1)
    if worker == 0:
        os.setsid()
        die_with(agent_pid, after_parent=middle)
        os.write(pid_write, str(os.getpid()).encode())
        return True
    os._exit(0)


def run_worker(request: WorkerRequest) -> None:
    """Become the worker of ``request`` and run its target as ``__main__`` (in the forked child,
    already the leader of a session of its own)."""
    _retitle(request.argv)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    _reseed()
    if request.module:
        sys.argv = ["-m", *request.args]
        sys.path[0] = os.getcwd()
        _run_as_main(lambda: runpy.run_module(request.target, run_name="__main__", alter_sys=True))
        return
    script = os.path.abspath(request.target)
    sys.argv = [request.target, *request.args]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    _run_as_main(lambda: _run_script(script))


def _run_script(path: str) -> None:
    """Run the file at ``path`` as ``python path`` runs it: a new ``__main__`` module."""
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins, __spec__=None,
                           __loader__=SourceFileLoader("__main__", path))
    sys.modules["__main__"] = module
    with io.open_code(path) as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    exec(code, module.__dict__)


def _run_as_main(run: Any) -> None:
    """Run ``run()``; an exception is reported as Python reports one escaping ``__main__`` (its
    traceback starting at the script) and exits with 1. ``SystemExit`` and ``KeyboardInterrupt``
    go on to the interpreter, which handles them as for any script."""
    try:
        run()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        # The warm process's frames, runpy's and the "-c" one that started it ("<string>").
        ours = {__file__, runpy.__file__}
        while tb is not None and (tb.tb_frame.f_code.co_filename in ours or tb.tb_frame.f_code.co_filename.startswith("<")):
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the hook shows the exception's own
        sys.exit(1)


def _retitle(argv: list[str]) -> None:
    """Show ``argv`` as this process's command line (``ps``, ``pgrep -f``, psutil), as a spawned
    worker's. setproctitle writes it over the inherited one and pads with NULs; a last byte that
    is not NUL makes the kernel show the title alone, without the padding as empty arguments."""
    setproctitle.setproctitle(" ".join(argv))
    with open("/proc/self/stat") as stat:
        after_name = stat.read().rsplit(")", 1)[1].split()
    arg_end = int(after_name[_ARG_END_FIELD - 3])
    last = ctypes.c_char.from_address(arg_end - 1)
    if last.value == b"\0":
        last.value = b" "


def _take_streams(fds: list[int]) -> None:
    """Put the worker's standard streams (received descriptors) on 0, 1, 2."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)


def _reseed() -> None:
    """Seed anew what a fresh interpreter seeds from the OS (``random`` reseeds itself on fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _fork_hazard() -> str:
    """Why forking this process now would give a broken worker, or "" when it is safe. Threads
    that Python started are lost in a fork with whatever they held; native pools that libraries
    quiesce around fork themselves (OpenBLAS's, loaded with numpy) are not counted."""
    if threading.active_count() > 1:
        names = ", ".join(thread.name for thread in threading.enumerate() if thread is not threading.main_thread())
        return f"the preload imports started Python threads ({names}); a forked worker would lack them"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "an import initialized CUDA in the warm process; a forked worker could not use it"
    return ""
