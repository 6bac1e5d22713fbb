"""A round's TCP connections, and how to cut them.

gloo has no abort: a rank blocked in a collective waits for its peer's bytes until the process
group's timeout, even after that peer left the round (its ``abort()`` and ``shutdown()`` leave the
connections open). A rank that leaves a round therefore shuts down every TCP connection it opened
since the round began (the process group's pairs, the save group's, the round's store client):
each peer blocked on one of them errors out at once. Listening sockets are left alone (gloo aborts
the process when its listener fails), and so is every connection that existed before the round (a
user's, opened outside the training function).

A round is cut in two steps (:class:`RoundConnections`), because gloo (torch 2.13) loses a send
that meets a broken connection: the send is queued without an error, and when the pair then fails,
an unbound buffer's send left in that queue is never told, so its collective waits for the process
group's timeout. First each connection is cut for reading: every read of this process, gloo's
included, ends at once, while what it still sends goes out. This process holds its own descriptor
of each connection meanwhile, so that gloo closing its own does not reset the connection under a
peer that is still sending. Then, ``WRITE_CUT_AFTER_S`` later, the writing side goes, which tells
the peers in order, and the held descriptors are closed once this process has left the next
round too (a peer frozen meanwhile finds the connection ended in order when it resumes).

A cut connection stays readable and hung up while its descriptors live, and the process groups
that own them live on in the worker: :meth:`RoundConnections.quiet` lets each wake this process's
event loops only once more (gloo's would otherwise spin on one; see :mod:`agent.epoll_registrations`).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

from agent.epoll_registrations import fire_once_more, registrations
from agent.open_descriptors import open_descriptors

WRITE_CUT_AFTER_S = 0.2
"""How long after the reading side of a round's connections their writing side is cut."""


def open_sockets() -> frozenset[str]:
    """The identities (``socket:[inode]``) of the sockets this process holds now."""
    return frozenset(link for _, link in _sockets())


class RoundConnections:
    """The TCP connections a round opened (those not in ``before``), to cut in two steps."""

    def __init__(self, before: frozenset[str]) -> None:
        self.before = before
        self._held: dict[str, socket.socket] = {}
        self._lock = threading.Lock()

    def cut(self, stop: threading.Event | None = None) -> None:
        """Cut for reading at once, then for writing ``WRITE_CUT_AFTER_S`` later (or as soon as
        ``stop`` is set: no thread of the round sends any more)."""
        self.shut(socket.SHUT_RD)
        (stop or threading.Event()).wait(WRITE_CUT_AFTER_S)
        self.shut(socket.SHUT_RDWR)

    def shut(self, how: int) -> int:
        """Shut down (``how``) each of the round's connected TCP sockets, holding a descriptor of
        each until :meth:`release`; how many were shut down."""
        cut = 0
        with self._lock:
            for link, fd in {link: fd for fd, link in _sockets() if link not in self.before}.items():
                sock = self._held.get(link) or self._hold(fd, link)
                if sock is None:
                    continue
                try:
                    sock.shutdown(how)
                    cut += 1
                except OSError:  # not connected (any more)
                    pass
        return cut

    def quiet(self) -> int:
        """Let each connection cut so far wake the event loops of this process once more, then no
        more; how many registrations were re-armed so."""
        with self._lock:
            inodes = {int(link.removeprefix("socket:[").removesuffix("]")) for link in self._held}
        return sum(1 for registration in registrations()
                   if registration.inode in inodes and fire_once_more(registration))

    def release(self) -> None:
        """Close the descriptors held (the connections end when their owners closed theirs)."""
        with self._lock:
            for sock in self._held.values():
                sock.close()
            self._held.clear()

    def _hold(self, fd: int, link: str) -> socket.socket | None:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            return None
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM \
                and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            self._held[link] = sock
            return sock
        sock.close()
        return None


def _sockets() -> Iterator[tuple[int, str]]:
    """(file descriptor, ``socket:[inode]``) of each socket this process holds (none without procfs:
    nothing to cut, the process group's timeout bounds the wait)."""
    return ((fd, link) for fd, link in open_descriptors() if link.startswith("socket:"))
