"""Train the llama-style GPT of examples/gpt/model.py on the Python standard library's source
(bytes), as a user of torchrevive would on a real job:

- FSDP2 (`fully_shard`, each block then the root) over the data-parallel ranks, with optional
  tensor parallelism (`--tp N`) on a 2-D DeviceMesh ("dp", "tp"); gloo on CPU, NCCL on CUDA;
- `torch.compile` per transformer block (`--compile auto`: on where a C compiler exists);
- AdamW, linear warm-up then cosine decay (a function of the step: nothing to checkpoint),
  gradient clipping by the global norm;
- a constant global batch of sequences at every world size, through `agent.ElasticSampler` and
  the gradient accumulation steps the agent hands over;
- `agent.Checkpointer` (storage and, where configured, the memory tier): resumes N -> M ranks from
  the snapshot the agent chose, saves every `checkpoint.interval_steps`.

    torchrevive run --nproc-per-node 2 examples/gpt/train.py --steps 50
    torchrevive run --nproc-per-node 4 examples/gpt/train.py --tp 2 --dim 256 --layers 4

Rank 0 prints the loss, tokens/s and the world every `--log-every` steps and, with `--marks PATH`,
appends each step's mark (examples/mlp.py's `mark`, with its samples and tokens); the first step
of a (re)start also reports `compile_s` and `compiles`, the seconds torch.compile spent and the
graphs it compiled in this round. It runs
through `agent.run_resilient`: with `elastic.in_process`, the process (and its compiled code)
lives across rounds, and each round re-shards and restores the model.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: examples.*

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import agent  # noqa: E402
from examples.gpt.data import stdlib_windows  # noqa: E402
from examples.gpt.model import GPT, GPTConfig, count_parameters  # noqa: E402
from examples.mlp import mark  # noqa: E402
from examples.worker_process import local_device, run_then_exit  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dim", type=int, default=512, help="model width (512 with the defaults: 19.5 M parameters)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn-hidden", type=int, default=None, help="feed-forward width (default: about 8/3 dim)")
    parser.add_argument("--tie-embeddings", action="store_true")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch-size", type=int, default=24,
                        help="sequences per optimizer step across all data-parallel ranks (24 divides by 1-4, 6, 8)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (the world must be a multiple)")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="torch.compile each block (auto: where a C compiler exists)")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="bf16: compute in bfloat16 through FSDP2's mixed precision (weights, optimizer state "
                             "and gradient reduction stay float32); auto: bf16 on a CUDA device that has it, else fp32")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--lr-decay-steps", type=int, default=None,
                        help="the step where the cosine ends (default: --steps; set it to keep the schedule of a "
                             "job whose --steps changes between runs)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine's floor, as a share of --lr")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--data-bytes", type=int, default=8_000_000, help="bytes of standard-library source to train on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--marks", default=None, help="rank 0 appends each step's mark (JSON lines) to this file")
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> GPTConfig:
    hidden = args.ffn_hidden or 64 * math.ceil(8 * args.dim / 3 / 64)
    return GPTConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, ffn_hidden=hidden,
                     max_seq_len=args.seq_len, tie_embeddings=args.tie_embeddings)


def compile_wanted(choice: str) -> bool:
    return choice == "on" or (choice == "auto" and shutil.which(os.environ.get("CC", "cc")) is not None)


def mixed_precision(choice: str, device: torch.device) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``--precision`` on ``device``: bf16 compute with float32 reductions, or
    float32 throughout."""
    bf16 = choice == "bf16" or (choice == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()


def meshes(world_size: int, tp: int, device_type: str) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The data-parallel mesh, and the tensor-parallel one when ``tp`` > 1."""
    if tp < 1 or world_size % tp:
        raise SystemExit(f"--tp {tp}: the world size {world_size} is not a multiple of it "
                         f"(set elastic.world_size_multiple_of: {tp} in the job config)")
    if tp == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",)), None
    mesh = init_device_mesh(device_type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def parallelize(model: GPT, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh | None, compile_blocks: bool,
                precision: MixedPrecisionPolicy) -> None:
    """Tensor parallelism inside each block, then torch.compile per block, then FSDP2 (each block,
    then the root) with the ``precision`` policy, in torchtitan's order."""
    for block in model.layers:
        if tp_mesh is not None:
            if model.config.n_heads % tp_mesh.size():
                raise SystemExit(f"--tp {tp_mesh.size()} must divide the {model.config.n_heads} heads")
            parallelize_module(block, tp_mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            })
        if compile_blocks:
            block.compile(dynamic=False)  # in place: the state dict keeps its names; static shapes
        fully_shard(block, mesh=dp_mesh, mp_policy=precision)
    fully_shard(model, mesh=dp_mesh, mp_policy=precision)


def sharded_model(config: GPTConfig, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh | None, compile_blocks: bool,
                  device: torch.device, precision: MixedPrecisionPolicy) -> GPT:
    """The model built on the meta device, parallelized, then given uninitialized storage of its
    own shards only (as torchtitan does): a restore or `initialize` sets every parameter, so a
    recovery spends no time initializing weights that are overwritten."""
    with torch.device("meta"):
        model = GPT(config)
    parallelize(model, dp_mesh, tp_mesh, compile_blocks, precision)
    model.to_empty(device=device)
    model.init_buffers()
    return model


def initialize(model: GPT, config: GPTConfig, seed: int) -> None:
    """A fresh start's weights: every rank initializes the whole model with one seed (the weights
    do not depend on the world) and keeps its own shards."""
    torch.manual_seed(seed)
    full = GPT(config)
    full.init_weights()
    set_model_state_dict(model, full.state_dict(), options=StateDictOptions(full_state_dict=True))


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to --lr, then a cosine down to --min-lr-ratio x --lr at --lr-decay-steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    decay_steps = args.lr_decay_steps or args.steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, decay_steps - args.warmup_steps))
    floor = args.lr * args.min_lr_ratio
    return floor + (args.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> float:
    """Scale the gradients so that their global norm is at most ``max_norm``; returns the norm.
    Works across meshes (FSDP2-only parameters are 1-D DTensors, TP ones 2-D)."""
    squares = []
    for param in parameters:
        if param.grad is None:
            continue
        norm = torch.linalg.vector_norm(param.grad.detach(), dtype=torch.float32)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for param in parameters:
        if param.grad is not None:
            param.grad.detach().mul_(scale.to(param.grad.device))
    return float(total)


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process (dynamo's own per-phase timers)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return sum(float(v) for name, v in zip(names, values) if name == "_compile.compile_inner")


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@record
def main() -> None:
    args = parse_args()
    device = local_device(agent.WorkerContext.from_env())
    config = model_config(args)
    compiled = compile_wanted(args.compile)
    precision = mixed_precision(args.precision, device)
    dataset = stdlib_windows(args.seq_len, args.data_bytes)

    def train(round: agent.Round) -> None:
        # The model is sharded for one world: built, sharded and compiled each round (compiled
        # code is cached in the process across in-process rounds), healed from the ranks' memory
        # when they hold every shard (a join), else restored from the snapshot the agent chose.
        ctx = round.context
        compile_before, graphs_before = compile_seconds(), compiled_graphs()
        dp_mesh, tp_mesh = meshes(ctx.world_size, args.tp, device.type)
        model = sharded_model(config, dp_mesh, tp_mesh, compiled, device, precision)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        if ctx.rank == 0:
            print(f"world_size={ctx.world_size} restart={ctx.restart_count} round={round.number} "
                  f"params={count_parameters(model)} dp={dp_mesh.size()} tp={args.tp} compile={compiled} "
                  f"compute={precision.param_dtype or torch.float32}", flush=True)

        accum = ctx.grad_accum_steps
        dp_size, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
        if args.global_batch_size % (dp_size * accum):
            raise SystemExit(f"--global-batch-size {args.global_batch_size} does not divide into {dp_size} "
                             f"data-parallel ranks x {accum} accumulation steps")
        micro = args.global_batch_size // (dp_size * accum)
        # Tensor-parallel ranks of one data-parallel group train the same sequences.
        sampler = agent.ElasticSampler(len(dataset), global_batch_size=args.global_batch_size,
                                       micro_batch_size=micro, rank=dp_rank, world_size=dp_size, seed=args.seed)
        loader = DataLoader(dataset, batch_size=micro, sampler=sampler)

        ckpt = agent.Checkpointer.from_env() if ctx.checkpoint_dir else None
        app_state = {"model": model, "optim": optimizer, "data": sampler}
        # In-process, at a join: every shard re-laid from the ranks' memory; else from the snapshot.
        restored = round.heal(app_state)
        if restored is None:
            restored = ckpt.restore(app_state) if ckpt else None
        if restored is None:
            initialize(model, config, args.seed)
        start = restored or 0
        if start and ctx.rank == 0:
            print(f"resumed from step {start}", flush=True)

        tokens_per_step = args.global_batch_size * args.seq_len
        batches = agent.batches_across_epochs(loader)
        window_start, window_steps = time.perf_counter(), 0
        for step in range(start, args.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args)
            total = torch.zeros((), device=device)
            for _ in range(accum):
                inputs, targets, _ = next(batches)
                logits = model(inputs.to(device))
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten()) / accum
                loss.backward()
                total += loss.detach()
            grad_norm = clip_grad_norm(list(model.parameters()), args.max_grad_norm)
            dist.all_reduce(total, group=dp_mesh.get_group())  # before the state changes (see examples/train.py)
            loss_value = total.item() / dp_size
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sampler.advance()
            window_steps += 1
            if ctx.rank == 0:
                first = step == start
                if (step + 1) % args.log_every == 0 or first:
                    rate = window_steps * tokens_per_step / (time.perf_counter() - window_start)
                    print(f"step={step + 1} loss={loss_value:.4f} grad_norm={grad_norm:.3f} "
                          f"lr={learning_rate(step, args):.2e} tokens/s={rate:.0f} world_size={ctx.world_size}",
                          flush=True)
                    window_start, window_steps = time.perf_counter(), 0
                if args.marks:
                    extra = {"compile_s": compile_seconds() - compile_before,
                             "compiles": compiled_graphs() - graphs_before} if first and compiled else {}
                    mark(args.marks, "first_step_done" if first else "step", step + 1, world_size=ctx.world_size,
                         samples=args.global_batch_size, tokens=tokens_per_step, loss=loss_value, **extra)
            round.step_done(step + 1)  # the round may end here, at the step's end: the step is kept
            if ckpt:
                ckpt.maybe_save(step + 1, app_state)
        if ckpt:
            ckpt.wait()

    def warmup(round: agent.Round) -> None:
        # A joining node's rehearsal (its workers alone, before it joins): the model built, sharded
        # and compiled for one step of the real step's shape, so that the job does not wait for
        # this node's compile. Synthetic tokens; nothing is kept.
        ctx = round.context
        if ctx.world_size % args.tp or args.global_batch_size % (ctx.world_size // args.tp * ctx.grad_accum_steps):
            return  # this node alone cannot hold the job's layout: it compiles in its first round
        dp_mesh, tp_mesh = meshes(ctx.world_size, args.tp, device.type)
        model = sharded_model(config, dp_mesh, tp_mesh, compiled, device, precision)
        micro = args.global_batch_size // (dp_mesh.size() * ctx.grad_accum_steps)
        tokens = torch.zeros((micro, args.seq_len), dtype=torch.long, device=device)
        model(tokens).float().mean().backward()

    agent.run_resilient(train, warmup=warmup)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_then_exit(main)
