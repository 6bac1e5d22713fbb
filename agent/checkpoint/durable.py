"""Small files that a crash must neither undo nor leave half-written, and removals that a crash
must not undo. Light on purpose (no torch): the agent and the worker's commit notice use it too.

A file is written to a temporary file of its own in the same directory (unique per writer, so
that concurrent writers never replace each other's half-written file), fsync'ed, renamed into
place, and the directory fsync'ed: a reader sees the old content or the new, and after the call
returns the new content survives a power loss.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, text: str, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` with ``text`` (a file of ``mode``), atomically and durably (see the module
    docstring). On any failure the temporary file is removed and ``path`` keeps its previous content.
    ``durable=False`` leaves out the fsyncs: for messages between live processes, which a power loss
    ends anyway (each fsync can take a second on a busy disk)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)  # mkstemp's is 600: a snapshot's readers may be other users
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def remove_file(path: Path) -> bool:
    """Remove ``path`` durably (its directory fsync'ed after the unlink); False when it was not there."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True
