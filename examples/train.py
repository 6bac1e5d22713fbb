"""A real small training job for torchrevive: an MLP regression on synthetic data, trained with
DDP (default) or FSDP2 (`--fsdp`), on gloo/CPU or NCCL/CUDA when GPUs are present.

Run it under `torchrevive run` (or torchrun); it prints one line per step with the loss and the
world size. When the job config names a checkpoint dir, it resumes from the latest committed
snapshot and saves every `checkpoint.interval_steps` steps. `--crash-at-step S` makes rank 0
fail at step S once per job (a marker file in the temp dir records it), to show the agent
restarting its workers.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

import agent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512, help="hidden width; 512 gives 0.56 M parameters (2.2 MB)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard instead of DDP")
    parser.add_argument("--crash-at-step", type=int, default=None, help="rank 0 fails at this step, once per job")
    return parser.parse_args()


def build_model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
        # 8 outputs, not 1: torchsnapshot cannot save an empty FSDP2 shard, which a 1-row layer
        # has on every rank but the first.
        nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8),
    )


def synthetic_batch(step: int, rank: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch for (step, rank): inputs and a smooth target to regress."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(batch_size, 64, generator=generator)
    y = torch.sin(x[:, :8].cumsum(dim=1))
    return x, y


def first_crash(run_id: str, step: int) -> bool:
    """True exactly once per (job, step) on this machine: ranks move between nodes across restarts,
    so neither the rank nor the restart count can tell whether the failure was injected already."""
    marker = os.path.join(tempfile.gettempdir(), f"torchrevive-{run_id}-crash-at-{step}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def wrap(model: nn.Module, use_fsdp: bool, device: torch.device) -> nn.Module:
    if use_fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


@record
def main() -> None:
    args = parse_args()
    ctx = agent.WorkerContext.from_env()
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", ctx.local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    torch.manual_seed(args.seed)
    model = wrap(build_model(args.width).to(device), args.fsdp, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if ctx.rank == 0:
        n_params = sum(p.numel() for p in build_model(args.width).parameters())
        print(f"world_size={ctx.world_size} restart={ctx.restart_count} params={n_params} "
              f"mode={'fsdp2' if args.fsdp else 'ddp'}", flush=True)

    # With a checkpoint dir in the job config: resume from the latest committed snapshot,
    # resharded to this world size, and save every checkpoint.interval_steps.
    ckpt = agent.Checkpointer.from_env() if ctx.checkpoint_dir else None
    app_state = {"model": model, "optim": optimizer}
    start = (ckpt.restore(app_state) or 0) if ckpt else 0
    if start and ctx.rank == 0:
        print(f"resumed from step {start}", flush=True)

    for step in range(start, args.steps):
        if step == args.crash_at_step and ctx.rank == 0 and first_crash(ctx.run_id, step):
            raise RuntimeError(f"injected failure at step {step} (--crash-at-step)")
        x, y = (t.to(device) for t in synthetic_batch(step, ctx.rank, args.batch_size, args.seed))
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        if ctx.rank == 0:
            print(f"step={step + 1} loss={reduced.item() / ctx.world_size:.6f} world_size={ctx.world_size}", flush=True)
        if ckpt:
            ckpt.maybe_save(step + 1, app_state)
    if ckpt:
        ckpt.wait()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        main()  # @record has written the error file for the agent when this raises
    except BaseException:
        traceback.print_exc()
        exit_code = 1
    else:
        exit_code = 0
    # The process group is left alive and the process ends without destructors: torch 2.13's
    # gloo process group can deadlock in its destructor when DDP's reducer drops the last
    # reference to it (a worker thread finishing a collective waits for the GIL that the
    # destructor holds), and the agent would then wait on this worker forever.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
