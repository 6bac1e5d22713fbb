"""CUDA restore benchmark: a model + Adam state restored by torchrevive from a snapshot (page cache
warm) into tensors on the GPU, beside plain host-to-device copies of the same bytes (pinned, the
cudaMemcpy ceiling; and pageable).

    python scripts/bench_cuda_restore.py --size-gb 2 --json out.json

JSON: {"size_bytes", "device", "torch", "date", "repeats", "results": {"torchrevive_gbps",
"h2d_pinned_gbps", "h2d_pageable_gbps"}, "ratio_vs_pinned"}, each figure the median of the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import agent
from agent.checkpoint import Checkpointer
from harness.bench_state import build_state, state_bytes


def timed(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        action()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    size = int(args.size_gb * 1e9)
    with tempfile.TemporaryDirectory(prefix="torchrevive-cuda-bench-") as tmp:
        model, optim = build_state(size, seed=0)
        Checkpointer(Path(tmp), staging=False).save(1, {"model": model, "optim": optim})
        nbytes = state_bytes(model, optim)
        host = [t for t in model.state_dict().values()] + [t for s in optim.state.values() for t in s.values()]
        pinned = [t.pin_memory() for t in host]
        device_model, device_optim = build_state(size, seed=1)
        device_model.cuda()
        for state in device_optim.state.values():
            for key, value in state.items():
                state[key] = value.cuda()
        targets = [torch.empty_like(t, device="cuda") for t in host]
        snapshot = Path(tmp) / "step_1"
        restore = lambda: agent.restore(snapshot, {"model": device_model, "optim": device_optim})
        restore()  # warm the page cache
        results = {
            "torchrevive_gbps": nbytes / timed(restore, args.repeats) / 1e9,
            "h2d_pinned_gbps": nbytes / timed(lambda: [d.copy_(s, non_blocking=True) for d, s in zip(targets, pinned)],
                                              args.repeats) / 1e9,
            "h2d_pageable_gbps": nbytes / timed(lambda: [d.copy_(s) for d, s in zip(targets, host)], args.repeats) / 1e9,
        }
        expected = build_state(size, seed=0)[0].state_dict()
        assert all(torch.equal(a.cpu(), b) for a, b in zip(device_model.state_dict().values(), expected.values()))
    report = {"size_bytes": nbytes, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "repeats": args.repeats, "results": results,
              "ratio_vs_pinned": results["torchrevive_gbps"] / results["h2d_pinned_gbps"]}
    for name, value in results.items():
        print(f"{name:20s} {value:7.2f} GB/s")
    print(f"torchrevive / pinned cudaMemcpy: {report['ratio_vs_pinned']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
