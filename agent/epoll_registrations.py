"""The epoll registrations of this process, as /proc shows them, and how to make one fire only once more.

Why: gloo's event loop busy-waits on a connection whose peer sent bytes for a buffer this side has not
registered yet ("this only happens at initialization time", its comment says): the handler returns
without reading, and a level-triggered event calls it again at once. When a round ends in the middle
of a collective, that buffer never comes; the connection, cut by :mod:`agent.round_sockets`, stays
readable and hung up; and the process group, kept by the worker across rounds, never closes it. Its
loop thread then spins for the rest of the process's life (measured: 60% of a core, 40-65% slower
steps on this 2-core machine after an in-process round). Re-arming such a registration as one-shot,
with the same data (the handler's pointer), delivers one more event, which any handler that acts on
an ended connection still gets, and then no more; the registration itself stays, so that its owner
removes it as usual when it finally closes the connection.

Linux only: /proc/self/fdinfo and epoll_ctl(2).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
from dataclasses import dataclass

from agent.open_descriptors import open_descriptors

EPOLL_CTL_MOD = 3
EPOLLONESHOT = 1 << 30

_REGISTRATION = re.compile(r"tfd:\s*(\d+)\s+events:\s*([0-9a-f]+)\s+data:\s*([0-9a-f]+).*?\bino:([0-9a-f]+)")


class _EpollEvent(ctypes.Structure):
    """``struct epoll_event``: packed on x86-64 (the kernel's ABI there), natural elsewhere."""

    _pack_ = 1 if platform.machine() in ("x86_64", "AMD64", "i386", "i686") else 0
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


@dataclass(frozen=True)
class Registration:
    """One file watched by one epoll instance of this process."""

    epoll_fd: int
    fd: int
    events: int
    data: int
    inode: int


def registrations() -> list[Registration]:
    """Every registration of every epoll instance this process holds (empty without procfs)."""
    found = []
    for epoll_fd in (fd for fd, link in open_descriptors() if link == "anon_inode:[eventpoll]"):
        try:
            with open(f"/proc/self/fdinfo/{epoll_fd}") as info:
                text = info.read()
        except OSError:  # closed meanwhile
            continue
        for match in _REGISTRATION.finditer(text):
            fd, events, data, inode = match.groups()
            found.append(Registration(epoll_fd, int(fd), int(events, 16), int(data, 16), int(inode, 16)))
    return found


def fire_once_more(registration: Registration) -> bool:
    """Re-arm ``registration`` as one-shot with its own data: one more event, then none. False if
    its file is no longer the one registered under that descriptor (closed, or the number reused)."""
    if _inode(registration.fd) != registration.inode:
        return False
    event = _EpollEvent(registration.events | EPOLLONESHOT, registration.data)
    if _libc().epoll_ctl(registration.epoll_fd, EPOLL_CTL_MOD, registration.fd, ctypes.byref(event)) != 0:
        return False  # removed by its owner meanwhile (ENOENT)
    return True


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
