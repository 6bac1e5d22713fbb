"""A round's TCP connections, and how to cut them.

gloo has no abort: a rank blocked in a collective waits for its peer's bytes until the process
group's timeout, even after that peer left the round (its ``abort()`` and ``shutdown()`` leave the
connections open). A rank that leaves a round therefore shuts down (``SHUT_RDWR``) every TCP
connection it opened since the round began (the process group's pairs, the save group's, the
round's store client): each peer blocked on one of them errors out at once. Listening sockets
are left alone (gloo aborts the process when its listener fails), and so is every connection that
existed before the round (a user's, opened outside the training function).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator


def open_sockets() -> frozenset[str]:
    """The identities (``socket:[inode]``) of the sockets this process holds now."""
    return frozenset(link for _, link in _sockets())


def cut_connections_since(before: frozenset[str]) -> int:
    """Shut down every connected TCP socket this process holds that is not in ``before``; the
    file descriptors stay open (their owners close them). Returns how many were cut."""
    cut = 0
    for fd, link in _sockets():
        if link in before:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                    and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
        except OSError:  # not connected (any more)
            pass
        finally:
            sock.close()
    return cut


def _sockets() -> Iterator[tuple[int, str]]:
    """(file descriptor, ``socket:[inode]``) of each socket this process holds."""
    for fd in _fds():
        link = _link(fd)
        if link is not None and link.startswith("socket:"):
            yield fd, link


def _fds() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no procfs: nothing to cut, the process group's timeout bounds the wait
        return []


def _link(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
