"""The training jobs the harness and the goodput benchmark run: the MLP of examples/train.py (sized by
its state in MB) or the GPT of examples/gpt/train.py (FSDP2, compiled per block), and what their
step marks say about compilation."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: examples.*
from examples.gpt.model import GPT, count_parameters  # noqa: E402
from examples.gpt.train import model_config, parse_args  # noqa: E402

WORKLOADS = ("mlp", "gpt")
SQUARE_LAYERS = 2
"""examples/train.py's MLP: 64 -> W, then two W x W layers, then W -> 8."""
GPT_SIZES: dict[str, list[str]] = {
    "default": [],  # examples/gpt/train.py's own: 19.5 M parameters
    "small": ["--dim", "256", "--layers", "4", "--heads", "4"],
    "tiny": ["--dim", "64", "--layers", "1", "--heads", "2", "--seq-len", "32", "--data-bytes", "400000"],
}
"""Sizes of the GPT, as examples/gpt/train.py flags (tiny: for the tests)."""
GPT_GLOBAL_BATCH, GPT_MICRO_BATCH = 24, 2
"""The GPT's sequences per step, and per rank per accumulation step at every world size (2 divides
the 6 of 4 ranks and the 8 of 3): a rank's batch keeps its shape across a recovery, so the blocks
compiled for static shapes are not compiled again, as on a real job whose per-device batch is
fixed by its memory."""


@dataclass(frozen=True)
class Workload:
    name: str
    script: str
    args: tuple[str, ...]
    """The script's flags that pick the model (not --steps or --marks)."""
    params: int
    state_bytes: int
    """Parameters and Adam's two moments, float32."""
    width: int | None = None
    """The MLP's hidden width (None for the GPT)."""
    batch: dict[str, int] | None = None
    """The agent's ``elastic.global_batch_size`` and ``elastic.micro_batch_size``, where the job keeps
    its per-rank batch at every world size (and varies the accumulation steps instead)."""


def width_for(state_mb: float) -> int:
    """The example MLP's hidden width whose parameters + Adam moments take about ``state_mb`` MB."""
    params = state_mb * 1e6 / (3 * 4)
    return max(64, int(math.sqrt(params / SQUARE_LAYERS)))


def mlp_params(width: int) -> int:
    return 64 * width + width + SQUARE_LAYERS * (width * width + width) + width * 8 + 8


def mlp_workload(width: int) -> Workload:
    """examples/train.py's MLP of hidden width ``width``."""
    return Workload("mlp", "examples/train.py", ("--width", str(width)), mlp_params(width), mlp_params(width) * 12,
                    width)


def workload_of(args: argparse.Namespace) -> Workload:
    """The job that ``--workload`` (with ``--state-mb``, or ``--gpt-size`` and ``--compile``) names."""
    if getattr(args, "workload", "mlp") == "mlp":
        return mlp_workload(width_for(args.state_mb))
    flags = (*GPT_SIZES[args.gpt_size], "--compile", args.compile, "--global-batch-size", str(GPT_GLOBAL_BATCH))
    with torch.device("meta"):  # counted without memory or initialization
        params = count_parameters(GPT(model_config(parse_args(list(flags)))))
    return Workload("gpt", "examples/gpt/train.py", flags, params, params * 12,
                    batch={"global_batch_size": GPT_GLOBAL_BATCH, "micro_batch_size": GPT_MICRO_BATCH})


def compile_cold_s(marks: list[dict], events: list[dict]) -> float | None:
    """The compile time of the job's first start: what rank 0's process had compiled by its first
    completed step (dynamo's own timers, as its checkpointer recorded them), or else what rank 0's
    first step marked. A process can compile in an in-process round that ends before its first
    step (a node late to the first round joins then), and its step's mark counts its own round
    only. None when the job compiles nothing."""
    first = next((m for m in marks if m["event"] == "first_step_done"), None)
    if first is None or first.get("compile_s") is None:
        return None
    done = [e for e in events if e["event"] == "first_step_done" and e.get("rank") == 0 and "compile_s" in e]
    return min(done, key=lambda e: e["time"])["compile_s"] if done else first["compile_s"]


WARMTH = ("none", "snapshot", "peer", "local")
"""What a node's workers compile from (the agent's ``compile_cache_ready``), coldest first."""


def compile_warm_from(events: list[dict], after: float) -> str | None:
    """What the workers started after ``after`` compiled from, the coldest node's (see
    :data:`WARMTH`); None without the agent's compile caches (``--compile-cache off``)."""
    ready = [e["warm_from"] for e in events if e["event"] == "compile_cache_ready" and e["time"] > after]
    return min(ready, key=WARMTH.index) if ready else None


def joined_compile_s(events: list[dict], after: float) -> float | None:
    """A join's compile: the longest a worker of the joining node compiled, in its rehearsal
    (``warmup_done``) or, on the restart path, where every worker is new, in its first step."""
    for kind in ("warmup_done", "first_step_done"):
        seconds = [e["compile_s"] for e in events if e["event"] == kind and e["time"] > after and "compile_s" in e]
        if seconds:
            return max(seconds)
    return None


def split_compile(timeline: dict, marks: list[dict], after: float) -> None:
    """Carve the compile time paid by the first step after ``after`` out of the timeline's
    ``first_step`` phase (it is part of it) as ``phases.compile``: the phases still add up to the
    recovery; ``recompiles`` is how many graphs dynamo compiled for it. Nothing when that step
    compiled nothing (compile off)."""
    first = next((m for m in marks if m["event"] == "first_step_done" and m["time"] > after), None)
    if first is None or first.get("compile_s") is None or "first_step" not in timeline["phases"]:
        return
    compile_s = min(first["compile_s"], timeline["phases"]["first_step"])
    timeline["phases"]["first_step"] -= compile_s
    timeline["phases"]["compile"] = compile_s
    timeline["recompiles"] = first.get("compiles")
