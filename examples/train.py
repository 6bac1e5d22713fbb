"""A real small training job for torchrevive: an MLP regression on synthetic data, trained with
DDP (default) or FSDP2 (`--fsdp`), on gloo/CPU or NCCL/CUDA when GPUs are present.

Run it under `torchrevive run` (or torchrun); it prints one line per step with the loss and the
world size. Data comes through `agent.ElasticSampler`: every optimizer step sees the same global
batch of samples (`--global-batch-size`) whatever the world size, with the gradient accumulation
steps the agent hands over. When the job config names a checkpoint dir, it resumes (model,
optimizer and data position) from the snapshot the agent chose and saves every
`checkpoint.interval_steps` steps. With `--marks PATH`, rank 0 appends one JSON line per step
(examples/mlp.py's `mark`, with the step's samples: the global batch), as
examples/classic_train.py does. `--crash-at-step S` makes rank 0
fail at step S once per job (a marker file in the temp dir records it), to show the agent
restarting its workers.

The training function runs through `agent.run_resilient`: with `elastic.in_process: true` in the
job config, survivors of a membership change keep their processes and heal the DDP state from
the newest step a live rank holds (FSDP2's shards too, when the ranks hold them all: a join; see
agent/resilient.py); otherwise it runs once per process.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from torch.distributed.elastic.multiprocessing.errors import record

import agent
from examples.mlp import build_model, mark, synthetic_dataset
from examples.worker_process import local_device, run_then_exit


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512, help="hidden width; 512 gives 0.56 M parameters (2.2 MB)")
    parser.add_argument("--global-batch-size", type=int, default=48,
                        help="samples per optimizer step across all ranks (48 divides by 1, 2, 3, 4, 6 ranks)")
    parser.add_argument("--samples", type=int, default=4096, help="dataset size")
    parser.add_argument("--log-samples", default=None,
                        help="append each step's sample ids, rank and round (JSON lines) to this file")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard instead of DDP")
    parser.add_argument("--crash-at-step", type=int, default=None, help="rank 0 fails at this step, once per job")
    parser.add_argument("--marks", default=None, help="rank 0 appends each step's mark (JSON lines) to this file")
    return parser.parse_args()


def first_crash(run_id: str, step: int) -> bool:
    """True exactly once per (job, step) on this machine: ranks move between nodes across restarts,
    so neither the rank nor the restart count can tell whether the failure was injected already."""
    marker = os.path.join(tempfile.gettempdir(), f"torchrevive-{run_id}-crash-at-{step}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def model_and_optimizer(args: argparse.Namespace, device: torch.device, *,
                        initialize: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The MLP and its Adam; FSDP2 shards the model (on the round's process group) before the
    optimizer sees its parameters."""
    torch.manual_seed(args.seed)
    model = build_model(args.width, device, initialize=initialize)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        model = fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=args.lr)


def wrap(model: nn.Module, use_fsdp: bool) -> nn.Module:
    """DDP around the kept model for this round (FSDP2's is sharded already). No initial copy of
    rank 0's parameters: every rank heals, restores or broadcasts them next."""
    if use_fsdp:
        return model
    device = next(model.parameters()).device
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                               init_sync=False)


def broadcast_state(model: nn.Module) -> None:
    """A new job: every rank starts from rank 0's initial parameters (what DDP's init_sync does)."""
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)


@record
def main() -> None:
    args = parse_args()
    first = agent.WorkerContext.from_env()
    device = local_device(first)
    dataset = synthetic_dataset(args.samples, args.seed)
    # The agent named a snapshot for this round: every parameter is about to be overwritten.
    resuming = first.checkpoint_dir is not None and first.restore_from is not None
    # DDP's model and optimizer outlive a round (its parameters are replicated: healed in-process
    # from a peer); FSDP2's are sharded for one world, so built each round.
    kept = None if args.fsdp else model_and_optimizer(args, device, initialize=not resuming)

    def train(round: agent.Round) -> None:
        ctx = round.context
        base, optimizer = kept or model_and_optimizer(args, device, initialize=not resuming)
        model = wrap(base, args.fsdp)
        if round.number == 0 and ctx.rank == 0:
            n_params = sum(p.numel() for p in model.parameters())  # a DTensor counts its global size
            print(f"world_size={ctx.world_size} restart={ctx.restart_count} params={n_params} "
                  f"mode={'fsdp2' if args.fsdp else 'ddp'}", flush=True)
        accum = ctx.grad_accum_steps
        micro = args.global_batch_size // (ctx.world_size * accum)
        sampler = agent.ElasticSampler(len(dataset), global_batch_size=args.global_batch_size, micro_batch_size=micro,
                                       seed=args.seed)
        loader = DataLoader(dataset, batch_size=micro, sampler=sampler)

        # With a checkpoint dir in the job config: resume from the newest state the live ranks hold
        # (in-process rounds: DDP's, or FSDP2's when no shard was lost), else from the snapshot the
        # agent chose, resharded to this world size; save every checkpoint.interval_steps.
        ckpt = agent.Checkpointer.from_env() if ctx.checkpoint_dir else None
        app_state = {"model": model, "optim": optimizer, "data": sampler}
        start = round.heal(app_state)
        if start is None:
            start = ckpt.restore(app_state) if ckpt else None
        if start is None:
            start = 0
            if not args.fsdp:
                broadcast_state(model)
        elif ctx.rank == 0:
            print(f"resumed from step {start}", flush=True)

        batches = agent.batches_across_epochs(loader)
        for step in range(start, args.steps):
            if step == args.crash_at_step and ctx.rank == 0 and first_crash(ctx.run_id, step):
                raise RuntimeError(f"injected failure at step {step} (--crash-at-step)")
            optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), device=device)
            step_batches = [next(batches) for _ in range(accum)]  # the rank's share of this step's global batch
            if args.log_samples:  # before the step's collectives: a rank killed in them has logged its share
                ids = [i for _, _, sample_ids in step_batches for i in sample_ids.tolist()]
                with open(args.log_samples, "a") as f:
                    f.write(json.dumps({"step": step + 1, "rank": ctx.rank, "world_size": ctx.world_size,
                                        "round": ctx.round, "ids": ids}) + "\n")
            for x, y, _ in step_batches:
                loss = nn.functional.mse_loss(model(x.to(device)), y.to(device)) / accum
                loss.backward()
                total += loss.detach()
            dist.all_reduce(total)  # before the state changes: a collective that fails leaves the step undone
            optimizer.step()
            sampler.advance()
            if ctx.rank == 0:
                loss_value = total.item() / ctx.world_size
                print(f"step={step + 1} loss={loss_value:.6f} world_size={ctx.world_size}", flush=True)
                if args.marks:
                    mark(args.marks, "first_step_done" if step == start else "step", step + 1,
                         world_size=ctx.world_size, samples=args.global_batch_size, loss=loss_value)
            round.step_done(step + 1)  # the round may end here, at the step's end: the step is kept
            if ckpt:
                ckpt.maybe_save(step + 1, app_state)
        if ckpt:
            ckpt.wait()

    agent.run_resilient(train)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_then_exit(main)
