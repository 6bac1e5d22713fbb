"""Write a buffer to a new file and make it durable, bypassing the page cache (``O_DIRECT``) where
the file system allows it.

A buffered write copies every byte into the page cache, whose pages the kernel then allocates,
writes back and keeps: CPU time and memory traffic taken from training while a background save
runs, and memory the snapshot's pages crowd. With ``O_DIRECT`` the disk reads the bytes from the
buffer itself. The kernel asks for aligned addresses, offsets and lengths (4 KiB here): the aligned
body of an aligned buffer goes straight to the disk; an unaligned buffer's body goes through a
small aligned bounce buffer reused per thread; the tail shorter than a block is written through
the page cache. So is the whole file on a file system that refuses ``O_DIRECT`` when the file is
opened (ramfs), and the rest of it where a direct write is refused (EINVAL: a file system that
asks for a larger alignment).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading

BLOCK = 4096
"""The alignment of direct writes: 4 KiB, the largest logical block size of Linux's disks; a file
system that asks for more refuses the writes, and the file is written through the page cache."""
BOUNCE_BYTES = 8 << 20
"""The aligned buffer an unaligned buffer's body is copied through, one per writing thread."""
_bounce = threading.local()


def write_durably(path: str, view: memoryview, *, direct: bool) -> int:
    """Write ``view`` (bytes) into a new file at ``path``, fsync it; the bytes that went to the disk
    directly (0 when ``direct`` is off, the file is shorter than a block, or its file system refuses
    ``O_DIRECT``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    body = len(view) - len(view) % BLOCK if direct else 0
    fd = _open_direct(path, flags) if body else None
    opened_direct = fd is not None
    if fd is None:
        fd = os.open(path, flags, 0o644)
    try:
        direct_bytes = 0
        if opened_direct:
            direct_bytes = _write_body(fd, view[:body])
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)  # for the rest
        write_all(fd, view[direct_bytes:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return direct_bytes


def aligned(nbytes: int) -> memoryview:
    """A new writable, page-aligned buffer of ``nbytes`` (private anonymous memory; a direct write
    takes it without a bounce)."""
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)) if nbytes else memoryview(bytearray())


def _open_direct(path: str, flags: int) -> int | None:
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: this file system has no O_DIRECT
            raise
        return None


def _write_body(fd: int, body: memoryview) -> int:
    """Write the block-aligned ``body`` directly (through the bounce buffer when ``body`` is not
    aligned in memory); the bytes written, all of them unless the file system refused a direct
    write (EINVAL), which leaves the file's offset after the bytes written before it."""
    try:
        if _address(body) % BLOCK == 0:
            write_all(fd, body)
        else:
            bounce = _bounce_buffer()
            for start in range(0, len(body), len(bounce)):
                chunk = bounce[:min(len(bounce), len(body) - start)]
                chunk[:] = body[start:start + len(chunk)]
                write_all(fd, chunk)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.lseek(fd, 0, os.SEEK_CUR)
    return len(body)


def write_all(fd: int, view: memoryview) -> None:
    """Write all of ``view`` to ``fd`` (``os.write`` may write less than it is given)."""
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])


def _address(view: memoryview) -> int:
    """The address of ``view``'s first byte; 1 (unaligned) for a read-only buffer, whose address
    ctypes does not give."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:
        return 1


def _bounce_buffer() -> memoryview:
    buffer = getattr(_bounce, "buffer", None)
    if buffer is None:
        buffer = _bounce.buffer = aligned(BOUNCE_BYTES)
    return buffer
