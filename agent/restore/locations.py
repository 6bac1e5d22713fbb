"""Files named inside a checkpoint stay inside it.

A checkpoint names its files by paths relative to its directory: torchsnapshot's manifest
entries (``location``), the checksum record, DCP's storage index (``relative_path``). A crafted
checkpoint could name an absolute path, climb out with ``..``, or ship a symlink that points out,
and so read any file the process can read into the weights. Each parser of such names checks them
here, once, before anything is read; everything downstream joins them to the directory as is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from agent.errors import RestoreError


def check_locations(root: Path, locations: Mapping[str, str], *, named_in: Path) -> None:
    """Refuse any location that is not a relative path inside ``root``.

    ``locations`` maps each location to a key stored there; ``named_in`` is the file that names
    them. A refusal is a RestoreError naming that file, the key and the location. Symlinks inside
    ``root`` are allowed while they resolve inside it.
    """
    real_root = root.resolve()
    inside: set[str] = set()  # paths already found inside: a directory shared by many files is checked once
    for location, key in locations.items():
        reason = _leaves(real_root, location, inside)
        if reason is not None:
            raise RestoreError(f"{named_in}: {key!r} is stored at {location!r}, {reason}; a checkpoint names only "
                               f"files inside its directory ({root}): it is damaged or crafted, restore another one")


def _leaves(real_root: Path, location: object, inside: set[str]) -> str | None:
    """Why ``location`` leads out of ``real_root``, or None when it stays inside."""
    if not isinstance(location, str) or "\0" in location or not PurePosixPath(location).parts:
        return "which is not a file name"
    relative = PurePosixPath(location)
    if relative.is_absolute():
        return "an absolute path"
    if ".." in relative.parts:
        return "a path with '..'"
    path = str(real_root)
    for part in relative.parts:
        path = os.path.join(path, part)
        if path in inside:
            continue
        if os.path.islink(path) and not Path(path).resolve().is_relative_to(real_root):
            return f"through a symlink that leads out of it ({path} -> {os.readlink(path)})"
        inside.add(path)
    return None
