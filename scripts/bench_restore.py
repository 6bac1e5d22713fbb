"""Restore benchmark: one model + Adam state, written once by torchrevive's Checkpointer
(torchsnapshot format, with checksums), torch.save and DCP, then restored into existing state by
each method, warm (page cache) and cold (pages evicted), each method in its own process so that
its peak extra RSS (the kernel's high-water mark VmHWM, reset after the destination state is
built, minus the resident size then) is its own.

    python scripts/bench_restore.py --size-gb 2 --json out.json

Prints a table and writes {"size_bytes", "results": {METHOD: {"warm_gbps", "cold_gbps",
"peak_extra_rss_bytes"}}, "verify": {...}, ...}. GB/s is state bytes (10^9) per
second of wall time. ``torchrevive`` restores with the default ``verify="sample"``; ``verify``
gives the cost of each verify mode against ``"off"``, measured in one process with the modes
interleaved (separate processes differ by more than the cost itself). ``torch_load`` also has
``stream_cold_s``: its file read cold in one sequential stream, interleaved with its cold
restores (this VM's disk moves by 2x within minutes; the read beside each restore moves with it).
Saving is measured by bench_save.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

from agent.restore.targets import optimizer_templates
from harness.bench_state import build_state, dcp_state, machine, state_bytes

METHODS = ["torchrevive", "torchsnapshot", "dcp", "dcp_fast", "torch_load", "torch_load_mmap", "raw_read"]
VERIFY_MODES = ("off", "sample", "full")
SNAPSHOT = Path("ckpt") / "step_1"
"""Where the Checkpointer's snapshot lies under the benchmark's root."""
def write_all(root: Path, size_bytes: int) -> None:
    import torch.distributed.checkpoint as dcp

    from agent.checkpoint import Checkpointer

    model, optim = build_state(size_bytes, seed=0)
    Checkpointer(root / "ckpt", staging=False).save(1, {"model": model, "optim": optim})
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, root / "state.pt")
    dcp.save(dcp_state(model, optim), checkpoint_id=str(root / "dcp"))
    os.sync()


def files_of(root: Path, method: str) -> list[Path]:
    where = {"dcp": root / "dcp", "dcp_fast": root / "dcp", "torch_load": root / "state.pt", "torch_load_mmap": root / "state.pt"}.get(
        method, root / SNAPSHOT)
    return [where] if where.is_file() else sorted(p for p in where.rglob("*") if p.is_file())


def evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: list[Path], threads: int) -> None:
    """Read every byte into a per-thread buffer (the /dev/null ceiling), files split in pieces,
    with as many threads as torchrevive's reader uses by default."""
    piece = 16 << 20
    jobs = [(p, off) for p in paths for off in range(0, p.stat().st_size, piece)]
    lock = threading.Lock()

    def worker() -> None:
        buf = bytearray(piece)
        while True:
            with lock:
                if not jobs:
                    return
                path, off = jobs.pop()
            with open(path, "rb", buffering=0) as f:
                os.preadv(f.fileno(), [buf], off)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def stream_read(path: Path) -> float:
    """Seconds to read ``path`` in one sequential stream (as one ``torch.load`` reader does)."""
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass
    return time.perf_counter() - start


def restore_once(method: str, root: Path, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    if method == "torchrevive" or method.startswith("verify_"):
        import agent

        agent.restore(root / SNAPSHOT, {"model": model, "optim": optim}, verify=method.removeprefix("verify_")
                      if method.startswith("verify_") else "sample")
    elif method == "torchsnapshot":
        import torchsnapshot

        torchsnapshot.Snapshot(str(root / SNAPSHOT)).restore({"model": model, "optim": optim})
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(dcp_state(model, optim), checkpoint_id=str(root / "dcp"))
    elif method == "dcp_fast":
        import torch.distributed.checkpoint as dcp

        from agent.restore.dcp_reader import FastStorageReader

        dcp.load(dcp_state(model, optim), storage_reader=FastStorageReader(root / "dcp"))
    elif method == "torch_load":
        state = torch.load(root / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
    elif method == "torch_load_mmap":
        state = torch.load(root / "state.pt", weights_only=True, mmap=True)
        model.load_state_dict(state["model"])
        # optim.load_state_dict would keep the lazily mapped tensors and read nothing yet: copy
        # into the existing state instead, so that every byte is really restored.
        params = optimizer_templates(optim)
        for index, param_state in state["optim"]["state"].items():
            for name, value in param_state.items():
                optim.state[params[index]][name].copy_(value)
    elif method == "raw_read":
        from agent.restore.reader import default_io_threads

        raw_read(files_of(root, method), default_io_threads())
    else:
        raise ValueError(method)


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of this process's resident set to its current size."""
    Path("/proc/self/clear_refs").write_text("5")


def measure_method(method: str, root: Path, size_bytes: int, repeats: int) -> dict:
    """In this (child) process: restore `repeats` times warm and cold; median seconds, peak RSS."""
    model, optim = build_state(size_bytes, seed=1)
    nbytes = state_bytes(model, optim)
    files = files_of(root, method)
    reset_peak_rss()
    baseline = status_bytes("VmRSS")
    result: dict = {"state_bytes": nbytes}
    for mode in ("warm", "cold"):
        times = []
        if mode == "warm":
            restore_once(method, root, model, optim)  # fill the page cache
        streams = []
        for _ in range(repeats):
            if mode == "cold" and method == "torch_load":
                evict(files)
                streams.append(stream_read(files[0]))
            if mode == "cold":
                evict(files)
            start = time.perf_counter()
            restore_once(method, root, model, optim)
            times.append(time.perf_counter() - start)
        if streams:
            result["stream_cold_s"] = statistics.median(streams)
        result[f"{mode}_s"] = statistics.median(times)
        result[f"{mode}_gbps"] = nbytes / result[f"{mode}_s"] / 1e9
    result["peak_extra_rss_bytes"] = max(0, status_bytes("VmHWM") - baseline)
    if method != "raw_read":
        expected, _ = build_state(size_bytes, seed=0)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values())), method
    return result


def measure_verify(root: Path, size_bytes: int, repeats: int) -> dict:
    """In this (child) process: restore with each verify mode, interleaved (in a rotating order),
    warm and cold; the median time of each mode relative to "off"."""
    model, optim = build_state(size_bytes, seed=1)
    files = files_of(root, "torchrevive")
    restore_once("torchrevive", root, model, optim)
    times: dict[str, list[float]] = {}
    for repeat in range(repeats):
        order = VERIFY_MODES[repeat % 3:] + VERIFY_MODES[: repeat % 3]  # no mode always runs first
        for temperature in ("warm", "cold"):
            for mode in order:
                if temperature == "cold":
                    evict(files)
                start = time.perf_counter()
                restore_once(f"verify_{mode}", root, model, optim)
                times.setdefault(f"{temperature}_{mode}", []).append(time.perf_counter() - start)
    median = {key: statistics.median(values) for key, values in times.items()}
    return {f"{mode}_cost_{temperature}": median[f"{temperature}_{mode}"] / median[f"{temperature}_off"] - 1
            for mode in VERIFY_MODES[1:] for temperature in ("warm", "cold")}


def run_child(args: argparse.Namespace, *child: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--size-gb", str(args.size_gb), "--repeats", str(args.repeats), *child],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "ROOT"), help=argparse.SUPPRESS)
    parser.add_argument("--verify-child", metavar="ROOT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size_bytes = int(args.size_gb * 1e9)
    if args.child:
        print(json.dumps(measure_method(args.child[0], Path(args.child[1]), size_bytes, args.repeats)))
        return
    if args.verify_child:
        print(json.dumps(measure_verify(Path(args.verify_child), size_bytes, args.repeats)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="torchrevive-bench-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        write_all(root, size_bytes)
        print(f"wrote the state three ways in {time.perf_counter() - t0:.1f} s", flush=True)
        results = {}
        for method in args.methods.split(","):
            results[method] = r = run_child(args, "--child", method, str(root))
            print(f"{method:16s} warm {r['warm_gbps']:6.2f} GB/s   cold {r['cold_gbps']:6.2f} GB/s   "
                  f"peak extra RSS {r['peak_extra_rss_bytes'] / 2**20:8.0f} MiB", flush=True)
        verify = run_child(args, "--verify-child", str(root))
    size = next(iter(results.values()))["state_bytes"]
    report = {"size_bytes": size, "machine": machine(), "repeats": args.repeats,
              "results": {m: {k: r[k] for k in ("warm_gbps", "cold_gbps", "peak_extra_rss_bytes", "warm_s", "cold_s",
                                                "stream_cold_s") if k in r}
                          for m, r in results.items()}}
    report["verify"] = verify
    for name, cost in verify.items():
        print(f"verify {name:33s} {cost * 100:+6.1f}% of restore time")
    if "torchrevive" in results:
        ours = results["torchrevive"]
        report["ratios"] = {f"torchrevive_vs_{m}_{mode}": ours[f"{mode}_gbps"] / r[f"{mode}_gbps"]
                            for m, r in results.items() if m != "torchrevive" for mode in ("warm", "cold")}
        if "dcp_fast" in results and "dcp" in results:
            fast = results["dcp_fast"]
            report["ratios"].update({f"dcp_fast_vs_{m}_{mode}": fast[f"{mode}_gbps"] / results[m][f"{mode}_gbps"]
                                     for m in ("dcp", "torchrevive") for mode in ("warm", "cold")})
        for name, ratio in report["ratios"].items():
            print(f"{name:40s} {ratio:6.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
