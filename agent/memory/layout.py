"""The memory directory's layout on a node: ``<memory_dir>/r<round>/step_<N>/``, one snapshot in
torchsnapshot's format, holding this node's ranks' files and a replica of its predecessor's
(node ``g`` is the buddy of node ``g - 1``). A memory snapshot is committed once its checksum
record and commit marker exist on two nodes: rank 0's and its buddy's. The marker names the
rendezvous run that wrote it: a snapshot of another run is never vouched for nor restored.

A node keeps its newest committed memory snapshot and the one being written, nothing older; a
save that fails leaves nothing behind.

Names and sizes that come from a peer or the store (an inventory, a choice) are data: each is
checked (a relative path inside its snapshot, integers where integers belong) before use.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import re
import shutil
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from agent.checkpoint.checksums import CHECKSUMS_FILE
from agent.checkpoint.dirs import COMMIT_MARKER

_SNAPSHOT = re.compile(r"r(0|[1-9][0-9]{0,17})/step_(0|[1-9][0-9]{0,17})", re.ASCII)
KEY_FILE = ".torchrevive_memory_key"
FETCHED_FILE = ".torchrevive_fetched"
INVENTORY_MAX_BYTES = 1 << 20
"""An inventory's most bytes, encoded, in the rendezvous store: under etcd's 1.5 MiB request limit."""
_INVENTORY_ENCODING = "zlib+b64:"
_INVENTORY_MAX_JSON_BYTES = 64 << 20
"""The most an inventory from the store may expand to (a small value must not inflate without bound)."""
_MAX_NAME_CHARS = 4096


@dataclass(frozen=True, order=True)
class MemorySnapshot:
    """A snapshot in a memory directory, ordered by round, then step."""

    round: int
    step: int

    @property
    def relative(self) -> str:
        return f"r{self.round}/step_{self.step}"

    @classmethod
    def parse(cls, relative: object) -> MemorySnapshot:
        """The snapshot at ``relative`` (exactly ``r<round>/step_<N>``); ValueError otherwise."""
        found = _SNAPSHOT.fullmatch(relative) if isinstance(relative, str) else None
        if found is None:
            raise ValueError(f"{str(relative)[:200]!r} is not a memory snapshot: expected r<round>/step_<step>, "
                             "both non-negative integers")
        return cls(int(found.group(1)), int(found.group(2)))


def safe_name(name: object) -> bool:
    """Whether a file name from a peer or the store is a relative path inside its snapshot."""
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME_CHARS or "\0" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


def snapshots(root: Path) -> list[MemorySnapshot]:
    """Every memory snapshot directory under ``root``, committed or not, oldest first."""
    found = []
    for round_dir in root.glob("r*"):
        for step_dir in round_dir.glob("step_*"):
            try:
                found.append(MemorySnapshot.parse(f"{round_dir.name}/{step_dir.name}"))
            except ValueError:
                continue
    return sorted(found)


def written_by(snapshot: Path, run: str) -> bool:
    """Whether ``snapshot``'s commit marker names the rendezvous run ``run``."""
    try:
        marker = json.loads((snapshot / COMMIT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("run") == run


def inventory(root: Path, run: str) -> dict[str, dict]:
    """What this node holds, for the round's leader: per snapshot, its files and sizes, and, where
    this node holds the commit marker of run ``run``, the snapshot's complete file list from its
    checksum record (and the run)."""
    held: dict[str, dict] = {}
    for snapshot in snapshots(root):
        path = root / snapshot.relative
        files = {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*")
                 if p.is_file() and not p.name.endswith(".incoming") and not p.name.startswith(FETCHED_FILE)}
        entry: dict = {"files": files}
        if COMMIT_MARKER in files and CHECKSUMS_FILE in files and written_by(path, run):
            try:
                record = json.loads((path / CHECKSUMS_FILE).read_text())
                entry["complete"] = {name: d["size"] for name, d in record["files"].items()}
                entry["complete"].update({CHECKSUMS_FILE: files[CHECKSUMS_FILE], COMMIT_MARKER: files[COMMIT_MARKER]})
                entry["run"] = run
            except (OSError, ValueError, KeyError, TypeError):
                pass  # a damaged record: this node cannot vouch for the snapshot
        held[snapshot.relative] = entry
    return held


def of_run(held: Mapping[str, Mapping[str, Any]], run: str) -> dict[str, dict]:
    """``held`` (an inventory) without its vouching for snapshots of any run but ``run``."""
    return {relative: (dict(entry) if entry.get("run") == run else {"files": entry.get("files", {})})
            for relative, entry in held.items()}


def encode_inventory(held: Mapping[str, Any]) -> str:
    """An inventory as the store keeps it: JSON, compressed (file names repeat their prefixes)."""
    raw = json.dumps(held, separators=(",", ":"), sort_keys=True).encode()
    return _INVENTORY_ENCODING + base64.b64encode(zlib.compress(raw, 6)).decode()


def fit_inventory(held: Mapping[str, Any]) -> tuple[str, list[str]]:
    """``held`` encoded within INVENTORY_MAX_BYTES, its oldest snapshots left out while it does
    not fit; the encoding and the snapshots left out."""
    kept = dict(held)
    left_out: list[str] = []
    while len(encoded := encode_inventory(kept)) > INVENTORY_MAX_BYTES:
        oldest = min(kept, key=MemorySnapshot.parse)
        del kept[oldest]
        left_out.append(oldest)
    return encoded, left_out


def decode_inventory(value: bytes | str, *, source: str) -> dict[str, dict]:
    """An inventory from the store (:func:`encode_inventory`), every name and size checked;
    ValueError naming ``source`` (the key) otherwise."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    try:
        if not text.startswith(_INVENTORY_ENCODING):
            raise ValueError(f"not an inventory (it starts {text[:20]!r})")
        inflate = zlib.decompressobj()
        raw = inflate.decompress(base64.b64decode(text.removeprefix(_INVENTORY_ENCODING), validate=True),
                                 _INVENTORY_MAX_JSON_BYTES)
        if inflate.unconsumed_tail:
            raise ValueError(f"it expands past {_INVENTORY_MAX_JSON_BYTES} bytes")
        held = json.loads(raw)
        if not isinstance(held, dict):
            raise ValueError("not a JSON object")
        for relative, entry in held.items():
            if MemorySnapshot.parse(relative).relative != relative or not isinstance(entry, dict):
                raise ValueError(f"{relative!r}: not a snapshot's entry")
            file_sizes(entry.get("files"), what=f"{relative} files")
            if "complete" in entry:
                file_sizes(entry["complete"], what=f"{relative} complete")
            if not isinstance(entry.get("run", ""), str):
                raise ValueError(f"{relative}: a run id that is not a string")
    except (ValueError, binascii.Error, zlib.error, UnicodeDecodeError) as exc:
        raise ValueError(f"the memory inventory at {source} in the rendezvous store is malformed ({exc}); "
                         "that node's memory snapshots are left out") from exc
    return held


def file_sizes(value: object, *, what: str) -> dict[str, int]:
    """``value`` when it maps file names inside a snapshot to sizes (or group ranks): ValueError
    naming ``what`` otherwise."""
    if not isinstance(value, dict):
        raise ValueError(f"{what}: not a mapping of file names")
    for name, size in value.items():
        if not safe_name(name):
            raise ValueError(f"{what}: {str(name)[:200]!r} is not a relative path inside the snapshot")
        if type(size) is not int or size < 0:
            raise ValueError(f"{what}: {name!r} has {size!r}, not a non-negative integer")
    return value


def mark_fetched(snapshot: Path, round: int, summary: dict) -> None:
    """Tell round ``round``'s workers that their agent is done pulling ``snapshot``'s files."""
    tmp = snapshot / f"{FETCHED_FILE}.r{round}.tmp"
    tmp.write_text(json.dumps(summary))
    tmp.rename(snapshot / f"{FETCHED_FILE}.r{round}")


def wait_fetched(snapshot: Path, round: int, *, timeout: float, poll: float = 0.005) -> bool:
    """Wait until the agent is done pulling ``snapshot``'s files for ``round``; False on timeout
    (the restore then finds what is missing, and falls back)."""
    done = snapshot / f"{FETCHED_FILE}.r{round}"
    deadline = time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def prune(root: Path, committed: MemorySnapshot) -> None:
    """Remove every snapshot older than ``committed`` (a newer one may be arriving already)."""
    for snapshot in snapshots(root):
        if snapshot < committed:
            shutil.rmtree(root / snapshot.relative, ignore_errors=True)
    _remove_empty_rounds(root)


def discard(root: Path, failed: MemorySnapshot) -> None:
    """Remove what this node holds of a snapshot that was not committed (its own files and the
    replica it received), so that a failed save leaves no RAM behind."""
    shutil.rmtree(root / failed.relative, ignore_errors=True)
    _remove_empty_rounds(root)


def _remove_empty_rounds(root: Path) -> None:
    for round_dir in root.glob("r*"):
        if round_dir.is_dir() and not any(round_dir.iterdir()):
            with contextlib.suppress(OSError):  # a snapshot of that round arriving meanwhile
                round_dir.rmdir()
