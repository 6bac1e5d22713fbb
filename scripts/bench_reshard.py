"""Resharding benchmark: FSDP2 model + Adam written by torchsnapshot at 4 ranks, restored by
torchrevive at 3 ranks and at 1 rank (gloo on CPU, real processes), and by torchsnapshot where
it can. Reports bytes read per rank, the rank's shard size, and GB/s.

    python scripts/bench_reshard.py --state-mb 512 --json reshard.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from harness.ports import free_port

WIDTH = 2048


def build(state_mb: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers = max(1, round(state_mb * 2**20 / (3 * 4 * WIDTH * WIDTH)))
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optim.step()
    return model, optim


def local_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    tensors = [v.to_local() for v in model.state_dict().values()]
    tensors += [v.to_local() if hasattr(v, "to_local") else v for s in optim.state.values() for v in s.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(rank: int, world_size: int, port: int, task: str, path: str, state_mb: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import torchsnapshot

    import agent

    model, optim = build(state_mb, seed=0 if task == "write" else 1)
    dist.barrier()
    start = time.perf_counter()
    record: dict = {"rank": rank, "shard_bytes": local_bytes(model, optim)}
    try:
        if task == "write":
            torchsnapshot.Snapshot.take(path, {"model": model, "optim": optim})
        elif task == "torchrevive":
            stats = agent.restore(path, {"model": model, "optim": optim})
            record["bytes_read"] = stats.bytes_read
        else:
            torchsnapshot.Snapshot(path).restore({"model": model, "optim": optim})
        record["seconds"] = time.perf_counter() - start
    except Exception as exc:  # torchsnapshot cannot restore some reshards: report, don't hide
        record["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    Path(out, f"{task}-{world_size}-{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    os._exit(0)  # no gloo teardown: its destructors can abort when peers exit at the same moment


def run(world_size: int, task: str, path: str, state_mb: int, out: str) -> list[dict]:
    mp.spawn(worker, args=(world_size, free_port(), task, path, state_mb, out), nprocs=world_size, join=True)
    return [json.loads(Path(out, f"{task}-{world_size}-{r}.json").read_text()) for r in range(world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mb", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report: dict = {"state_mb": args.state_mb, "written_at": 4, "restores": []}
    with tempfile.TemporaryDirectory(prefix="torchrevive-reshard-") as tmp:
        path = str(Path(tmp, "snapshot"))
        run(4, "write", path, args.state_mb, tmp)
        for world_size in (3, 1):
            for method in ("torchrevive", "torchsnapshot"):
                ranks = run(world_size, method, path, args.state_mb, tmp)
                slowest = max((r.get("seconds", 0.0) for r in ranks), default=0.0)
                total = sum(r["shard_bytes"] for r in ranks)
                entry = {"method": method, "world_size": world_size, "ranks": ranks,
                         "gbps": total / slowest / 1e9 if slowest and not any("error" in r for r in ranks) else None}
                report["restores"].append(entry)
                for r in ranks:
                    read = r.get("bytes_read")
                    amp = f"{read / r['shard_bytes']:.3f}x of shard" if read else "n/a"
                    print(f"{method:13s} 4->{world_size} rank {r['rank']}: shard {r['shard_bytes'] / 2**20:7.1f} MiB, "
                          f"read {amp}, {r.get('seconds', float('nan')):.2f} s {r.get('error', '')}")
                if entry["gbps"]:
                    print(f"{method:13s} 4->{world_size}: {entry['gbps']:.2f} GB/s (state bytes / slowest rank)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
