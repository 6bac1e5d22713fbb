"""This process's open file descriptors and what each names, from /proc/self/fd."""

from __future__ import annotations

import os
from collections.abc import Iterator


def open_descriptors() -> Iterator[tuple[int, str]]:
    """(file descriptor, what it names: ``socket:[inode]``, ``anon_inode:[eventpoll]``, a path) of
    each descriptor this process holds; none without procfs. One closed meanwhile is left out."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            yield int(name), os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
