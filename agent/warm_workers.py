"""Workers forked from a warm process (:mod:`agent.warm_process`) instead of started cold.

The agent keeps one warm process: an interpreter that has imported torch and ``launch.preload``.
torch's ``SubprocessHandler`` still does everything it does for a spawned worker (the environment
it merges, the log files it opens for redirects and tee); only its ``Popen`` is replaced: the warm
process forks the worker with that command line, environment, directory and those files. The
agent is a child subreaper, so the worker is re-parented to it and is its child, as a spawned
one: torch polls, waits for and signals it (``killpg``) as before, and reads its exit code.

A worker spawns as before, with the reason in the ``workers_started`` event, when the warm one
could not be the same process: another interpreter or flags (``--no-python``, numactl binding), an
environment variable that differs from the warm process's (other than the round's own), or a warm
process that failed, is gone, or is not ready in time.

Spawned or forked, a worker dies with its agent (:mod:`agent.worker_lifetime`). As a subreaper,
the agent also adopts what its workers leave behind (a killed worker's data-loader processes):
:func:`keep_reaping_orphans` reaps those as they exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import psutil
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from agent.warm_process import MAX_MESSAGE
from agent.worker_lifetime import dying_with_agent

ALWAYS_PRELOADED = ("torch", "torch.distributed", "agent.checkpoint.checkpointer", "agent.restore.engine",
                    "agent.elastic_sampler")
"""What every warm process imports before ``launch.preload``: torch and torchrevive's worker API
(the Checkpointer and restore engine bring torchsnapshot and DCP)."""
READY_WAIT_S = 60.0
"""How long workers wait for a warm process still importing before they spawn instead."""
REPLY_WAIT_S = 10.0
"""How long the agent waits for the warm process to fork one worker."""
INTERPRETER_FLAGS = ("-u",)
"""What torchrun puts between the interpreter and the script; the warm process runs with them."""
ENVIRONMENT_CHANGED = "environment variables differ from the warm process's"
_PR_SET_CHILD_SUBREAPER = 36
_START = "from agent.warm_process import main; import sys; main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])"
ORPHAN_REAP_INTERVAL_S = 1.0
"""How often the agent reaps exited orphans it adopted (they are zombies until then)."""


class WarmProcess:
    """The agent's warm process: started at once, it imports in the background.

    Args:
        preload: modules to import after :data:`ALWAYS_PRELOADED`, before any worker is forked.
        env: its environment (the agent's); a worker whose environment differs from it in more
            than the round's own variables is spawned.
    """

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self.preload = [*ALWAYS_PRELOADED, *(name for name in preload if name not in ALWAYS_PRELOADED)]
        self.problem = ""
        """Why the warm process cannot be used, once it is known; "" while it can."""
        self.refused = ""
        """The warm process's own refusal (its imports failed, or left it unsafe to fork): a new
        one would refuse too."""
        self._ready = False
        self._channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, *INTERPRETER_FLAGS, "-c", _START, str(theirs.fileno()), str(os.getpid()), *self.preload],
                env=self.env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        """The warm process's PID."""
        return self._process.pid

    def unusable_for(self, argv: Sequence[str], env: Mapping[str, str], round_keys: Collection[str]) -> str:
        """Why a worker with this command line and environment cannot be forked from this warm
        process ("" when it can); ``round_keys`` may differ from the warm process's environment."""
        if len(argv) < len(INTERPRETER_FLAGS) + 2 or argv[0] != sys.executable:
            return f"the worker's command {argv[0]!r} is not this Python ({sys.executable})"
        if tuple(argv[1:1 + len(INTERPRETER_FLAGS)]) != INTERPRETER_FLAGS:
            return f"the worker's interpreter flags {list(argv[1:3])} are not {list(INTERPRETER_FLAGS)}"
        target = argv[1 + len(INTERPRETER_FLAGS)]
        if target.startswith("-") and target != "-m":
            return f"the worker's interpreter option {target!r} is not one a warm process can take"
        changed = sorted(key for key in self.env.keys() | env.keys()
                         if key not in round_keys and self.env.get(key) != env.get(key))
        if changed:
            return f"{ENVIRONMENT_CHANGED}: {', '.join(changed[:5])}"
        return self.wait_ready()

    def fork(self, argv: Sequence[str], env: Mapping[str, str], streams: Sequence[int]) -> AdoptedProcess:
        """Fork a worker that runs ``argv`` (as :meth:`unusable_for` accepted it) with ``env`` and
        the standard streams ``streams`` (descriptors for 0, 1, 2), in this directory. Raises
        OSError when the warm process cannot: for this worker alone (its request too large to
        hand over), or for good (its problem is set then)."""
        after_flags = list(argv[1 + len(INTERPRETER_FLAGS):])
        module = after_flags[0] == "-m"
        target, *args = after_flags[1:] if module else after_flags
        request = {"argv": list(argv), "target": target, "module": module, "args": args, "env": dict(env), "cwd": os.getcwd()}
        message = json.dumps(request).encode()
        if len(message) > MAX_MESSAGE:
            raise OSError(errno.EMSGSIZE, f"the worker's command line and environment ({len(message)} bytes) are more "
                                          f"than a warm process takes ({MAX_MESSAGE})")
        children = _child_pids()  # to tell a worker forked too late from this agent's other children
        try:
            socket.send_fds(self._channel, [message], list(streams))
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:  # this socket's limit, below ours: this worker alone is spawned
                raise
            self.problem = f"the warm process is gone ({exc})"
            raise
        try:
            reply = self._receive(REPLY_WAIT_S)
        except TimeoutError:
            # It may still fork the worker: end it, and any worker it forked, before one is spawned.
            self.problem = f"the warm process did not fork a worker within {REPLY_WAIT_S:.0f} s"
            self._end_with_its_workers(children)
            raise
        except (OSError, ValueError) as exc:
            self.problem = f"the warm process is gone ({exc})"
            raise OSError(self.problem) from exc
        if "pid" not in reply:
            self._refusal(reply)
            raise OSError(self.problem)
        return AdoptedProcess(int(reply["pid"]))

    def alive(self) -> bool:
        """Whether the warm process is still running."""
        return self._process.poll() is None

    def _end_with_its_workers(self, children: set[int]) -> None:
        """Kill the warm process and whatever it forked that was not handed over: still its
        descendant, or re-parented to this process since ``children`` were its children (a
        worker forked after the reply's wait ran out)."""
        try:
            forked = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            forked = []
        self.close()
        _kill_and_wait(forked)  # what they forked meanwhile is re-parented here once they are gone
        reparented = []
        for pid in _child_pids() - children:
            with contextlib.suppress(psutil.NoSuchProcess):
                reparented.append(psutil.Process(pid))
        _kill_and_wait(reparented)

    def close(self) -> None:
        """End the warm process (workers forked from it go on: they are not its children)."""
        self._channel.close()
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()

    def wait_ready(self) -> str:
        """Wait (up to :data:`READY_WAIT_S`) until the warm process has imported; why it cannot be
        used, or "" once it is ready."""
        if self._ready or self.problem:
            return self.problem
        alive = self.alive()
        try:
            reply = self._receive(READY_WAIT_S if alive else 0.0)
        except OSError as exc:
            self.problem = (f"the warm process did not get ready ({exc})" if alive else
                            f"the warm process exited with {self._process.returncode} before it was ready")
            return self.problem
        if reply.get("ready"):
            self._ready = True
        else:
            self._refusal(reply)
        return self.problem

    def _refusal(self, reply: dict[str, Any]) -> None:
        self.problem = reply.get("error", f"unexpected reply {reply}")
        if reply.get("lasting"):
            self.refused = self.problem

    def _receive(self, timeout: float) -> dict[str, Any]:
        readable, _, _ = select.select([self._channel], [], [], timeout)
        if not readable:
            raise TimeoutError(f"no answer from the warm process within {timeout:.0f} s")
        message = self._channel.recv(MAX_MESSAGE)
        if not message:
            raise ConnectionError("the warm process closed its socket")
        return json.loads(message)


class AdoptedProcess:
    """A worker the agent did not start itself but is the parent of (re-parented to it as a
    subreaper): the part of ``subprocess.Popen`` that torch's SubprocessContext uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is unknown, report a failure
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None, "poll() returned a code"
        return self.returncode


class SpawnedSubprocessHandler(SubprocessHandler):
    """torch's SubprocessHandler whose worker, spawned as torch spawns it (a session of its own,
    which the agent signals), dies with the agent. Made with the keyword arguments of torch's
    ``get_subprocess_handler``."""

    def _popen(self, args: tuple, env: dict[str, str]) -> Any:
        return subprocess.Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr, start_new_session=True,
                                preexec_fn=dying_with_agent())


class WarmSubprocessHandler(SpawnedSubprocessHandler):
    """torch's SubprocessHandler whose process is forked from ``warm`` when it can be (see the
    module), else spawned; ``spawn_reason`` tells why ("" when forked).

    Args:
        warm: the agent's warm process.
        **kwargs: as for torch's ``get_subprocess_handler``; the variables of ``env`` (torch's
            for the worker and the round's, the worker contract) may differ from the warm
            process's environment.
    """

    def __init__(self, warm: WarmProcess, **kwargs: Any) -> None:
        self._warm = warm
        self._round_keys = frozenset(kwargs["env"])
        self.spawn_reason = ""
        self.environment_changed = False
        """The worker was spawned because the environment is not the warm process's any more."""
        super().__init__(**kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> Any:
        self.spawn_reason = self._warm.unusable_for(args, env, self._round_keys)
        self.environment_changed = self.spawn_reason.startswith(ENVIRONMENT_CHANGED)
        if not self.spawn_reason:
            streams = [0, self._stdout.fileno() if self._stdout else 1, self._stderr.fileno() if self._stderr else 2]
            try:
                return self._warm.fork(args, env, streams)
            except OSError as exc:
                self.spawn_reason = str(exc)
        return super()._popen(args, env)


def _kill_and_wait(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=5)


def _child_pids() -> set[int]:
    """This process's children, from each of its threads' ``/proc`` children list (cheap: no scan
    of every process), or psutil's scan where the kernel has no such list."""
    pids: set[int] = set()
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as children:
                pids.update(int(pid) for pid in children.read().split())
    except OSError:
        return {child.pid for child in psutil.Process().children()}
    return pids


def become_subreaper() -> None:
    """Make orphaned descendants of this process its children (Linux ``PR_SET_CHILD_SUBREAPER``),
    so that a worker forked by the warm process is re-parented here. OSError where unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(errno)}")


def reap_orphans(keep: Collection[int] | None = None) -> int:
    """Reap exited orphans this process adopted as a subreaper: its workers' children that
    outlived them (e.g. a killed worker's data-loader processes). Returns how many.

    What the agent starts itself (the warm process, any subprocess) is in its session and waited
    for where it was started: never reaped here. Its workers lead sessions of their own and are
    waited for by their handlers: with ``keep`` None, only exited children that lead no session
    are reaped (safe at any time, from any thread); with ``keep``, also session leaders other than
    ``keep`` (call it so only when no exited worker awaits its handler's wait: between rounds)."""
    own_session = os.getsid(0)
    reaped = 0
    for pid in _child_pids() - set(keep or ()):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state, _, _, session = stat.read().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):  # reaped meanwhile
            continue
        if state != "Z" or int(session) == own_session or (keep is None and int(session) == pid):
            continue
        with contextlib.suppress(ChildProcessError):
            reaped += bool(os.waitpid(pid, os.WNOHANG)[0])
    return reaped


_orphan_reaper: threading.Thread | None = None


def keep_reaping_orphans(interval_s: float = ORPHAN_REAP_INTERVAL_S) -> None:
    """Reap exited orphans (:func:`reap_orphans` without ``keep``) every ``interval_s`` seconds
    from now on, in a daemon thread: one per process, however often this is called."""
    global _orphan_reaper
    if _orphan_reaper is not None:
        return

    def reap_forever() -> None:
        while True:
            time.sleep(interval_s)
            reap_orphans()

    _orphan_reaper = threading.Thread(target=reap_forever, name="torchrevive-orphan-reaper", daemon=True)
    _orphan_reaper.start()
