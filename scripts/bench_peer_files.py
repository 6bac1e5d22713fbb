"""Data-plane benchmark: how fast the memory tier pulls a file from a peer agent over loopback,
with the shipped MAC (keyed BLAKE3) and, side by side in the same run, with HMAC-SHA256 in its
place (the MAC it had before); and the two MACs' hashing speed alone, on one core.

    python scripts/bench_peer_files.py --size-mb 256 --rounds 5 --json out.json

Writes {"size_bytes", "rounds", "machine", "results": {MAC: {"hash_gbps", "pull_gbps",
"pull_parallel_gbps", "pull_s": [...], "pull_parallel_s": [...]}}} for MAC in blake3 and
hmac_sha256. ``pull_gbps``: one client pulls the file through a real PeerFileServer and
PeerFileClient (handshake, MAC checked, file renamed into place); ``pull_parallel_gbps``: two
clients pull two such files at once (a node pulls from two holders). Medians over ``rounds``, the
two MACs interleaved in each round.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import blake3

from agent.memory import peer_files
from agent.memory.peer_files import PeerFileClient, PeerFileServer
from harness.bench_state import machine

MACS: dict[str, Callable[[bytes, bytes], Any]] = {
    "blake3": lambda key, prefix: blake3.blake3(prefix, key=key),
    "hmac_sha256": lambda key, prefix: hmac.new(key, prefix, "sha256"),
}
SECRET = b"bench-peer-files-secret"


@contextmanager
def mac_of(name: str) -> Iterator[None]:
    """The data plane with MAC ``name`` (for this benchmark's comparison row only)."""
    shipped = peer_files._Channel._mac
    if name != "blake3":
        peer_files._Channel._mac = lambda self, seq: MACS[name](self._key, seq.to_bytes(8, "big"))
    try:
        yield
    finally:
        peer_files._Channel._mac = shipped


def hash_gbps(name: str, data: memoryview) -> float:
    """One core's MAC speed over ``data`` in 4 MB updates, as the data plane feeds it."""
    started = time.perf_counter()
    mac = MACS[name](b"k" * 32, b"")
    for start in range(0, len(data), peer_files.CHUNK_BYTES):
        mac.update(data[start:start + peer_files.CHUNK_BYTES])
    mac.digest()
    return len(data) / (time.perf_counter() - started) / 1e9


def pull_s(server: PeerFileServer, names: list[str], dest: Path) -> float:
    """Seconds for len(names) clients to pull one file each, at once."""
    def pull(name: str) -> None:
        with PeerFileClient(server.address, SECRET, round=1) as client:
            client.get(name, dest / name)

    threads = [threading.Thread(target=pull, args=(name,)) for name in names]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    for name in names:
        if not (dest / name).is_file():
            raise RuntimeError(f"the pull of {name} failed")
        (dest / name).unlink()
    return seconds


def run(size_bytes: int, rounds: int, work: Path) -> dict[str, Any]:
    served, dest = work / "served", work / "pulled"
    served.mkdir()
    dest.mkdir()
    payload = os.urandom(size_bytes)
    for name in ("a", "b"):
        (served / name).write_bytes(payload)
    server = PeerFileServer(served, SECRET, host="127.0.0.1")
    server.round = 1
    timings: dict[str, dict[str, list[float]]] = {m: {"hash": [], "one": [], "two": []} for m in MACS}
    try:
        for round_ in range(rounds):
            for name in list(MACS)[round_ % 2:] + list(MACS)[:round_ % 2]:
                with mac_of(name):
                    timings[name]["hash"].append(hash_gbps(name, memoryview(payload)))
                    timings[name]["one"].append(pull_s(server, ["a"], dest))
                    timings[name]["two"].append(pull_s(server, ["a", "b"], dest))
    finally:
        server.close()
    return {name: {"hash_gbps": round(statistics.median(t["hash"]), 3),
                   "pull_gbps": round(size_bytes / statistics.median(t["one"]) / 1e9, 3),
                   "pull_parallel_gbps": round(2 * size_bytes / statistics.median(t["two"]) / 1e9, 3),
                   "pull_s": [round(s, 4) for s in t["one"]], "pull_parallel_s": [round(s, 4) for s in t["two"]]}
            for name, t in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm", help="where the files go (the memory tier's tmpfs)")
    parser.add_argument("--json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="torchrevive-bench-peer-", dir=args.dir))
    try:
        results = run(args.size_mb << 20, args.rounds, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"size_bytes": args.size_mb << 20, "rounds": args.rounds, "machine": machine(), "results": results}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
