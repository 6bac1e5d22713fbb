"""Save benchmark: how long one save blocks the training thread, and how long until the snapshot is
done, for torchrevive's staged save and its peers, on the same model + Adam state as
bench_restore.py, each method in its own process (a one-rank gloo group: the asynchronous peers
need one), the methods interleaved in a rotating order, median over the rounds.

    python scripts/bench_save.py --size-gb 2 --json out.json

Writes {"size_bytes", "results": {M: {"blocking_s", "done_s", "durable_s", "first_blocking_s",
"slowdown", ...}}, ...}
for M in torchrevive (its defaults: writer threads at niceness 10, 2 writes in flight, tensors under
4 MB batched, files written around the page cache), torchrevive_buffered (through the page cache,
``direct_io=False``), torchrevive_idle (the writer threads under SCHED_IDLE instead), torchrevive_nice19
(at niceness 19), torchrevive_io1 (1 write in flight),
torchrevive_slabs128 (torchsnapshot's own batching, of tensors under 128 MB: the earlier default),
torchsnapshot_take,
torchsnapshot_async_take, dcp_save, dcp_async_save.
``blocking_s``: the training thread is blocked by one save in steady state (a save after the
first one in the same process, as training sees it every interval) until it may change the state
again; ``first_blocking_s``: the same for the first save (staging buffers are allocated then).
``done_s``: from the call until the method reports the snapshot done; ``durable_s``: until it is
done and on disk, like for like: torchrevive's and DCP's "done" come after an fsync of every file,
torchsnapshot's does not (``fsyncs``), so its files and directories are fsync'ed here once it is
done, and that time is added. ``slowdown``: a training step of the same model (forward, backward and Adam
on a batch of 16) while background saves are written back to back, over the same step with no save
in flight: the median step of each kind over two quiet and two saving windows of
``--slowdown-window-s`` each, alternating (None for the methods that write before they return).
A method whose process fails is left out of the later rounds and reported under "failed" with the
end of its error output; the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness.bench_state import WIDTH, build_state, dcp_state, machine, state_bytes

TORCHREVIVE_VARIANTS: dict[str, dict[str, Any]] = {
    "torchrevive": {}, "torchrevive_buffered": {"direct_io": False}, "torchrevive_idle": {"writer_nice": "idle"},
    "torchrevive_nice19": {"writer_nice": 19},
    "torchrevive_io1": {"write_threads": 1}, "torchrevive_slabs128": {}}
"""torchrevive's save with its defaults, and each variant's ``Checkpointer`` settings that differ."""
FSYNCS = {**dict.fromkeys(TORCHREVIVE_VARIANTS, True), "torchsnapshot_take": False,
          "torchsnapshot_async_take": False, "dcp_save": True, "dcp_async_save": True}
"""Whether the method's "done" means on disk: DCP's FileSystemWriter fsyncs each file (its
``sync_files``, on by default); torchsnapshot's file-system plugin does not."""
METHODS = list(FSYNCS)

Save = Callable[[int], tuple[Callable[[], None], Callable[[], bool]]]
"""Starts save number i; returns once the caller may change the state again, with a function
that waits until the save is done and one that says whether it is."""
BATCH = 16
"""Rows of a timed training step's batch."""
SLOWDOWN_WINDOWS = 2
"""Quiet and saving windows, each, in which the steps' slowdown is measured."""


def written(_: object) -> tuple[Callable[[], None], Callable[[], bool]]:
    """For a save that is done when it returns (whatever it returned)."""
    return lambda: None, lambda: True


def saver(method: str, root: Path, model: Any, optim: Any) -> Save:
    """The save of ``method`` into ``root``, as a user of that method writes it."""
    import torch.distributed.checkpoint as dcp
    import torchsnapshot

    from agent.checkpoint import Checkpointer
    from agent.checkpoint.write import SLAB_THRESHOLD_ENV

    app = {"model": model, "optim": optim}
    if method in TORCHREVIVE_VARIANTS:
        # Old snapshots are removed outside the timing, as for the others.
        if method == "torchrevive_slabs128":  # the environment's threshold wins over ours
            os.environ[SLAB_THRESHOLD_ENV] = str(128 << 20)
        ckpt = Checkpointer(root, keep=1_000, **TORCHREVIVE_VARIANTS[method])

        def save(i: int) -> tuple[Callable[[], None], Callable[[], bool]]:
            ckpt.save(i, app)
            return ckpt.wait, lambda: not ckpt.saving()
        return save
    if method == "torchsnapshot_take":
        return lambda i: written(torchsnapshot.Snapshot.take(str(root / f"step_{i}"), app))
    if method == "torchsnapshot_async_take":
        def save_async(i: int) -> tuple[Callable[[], None], Callable[[], bool]]:
            pending = torchsnapshot.Snapshot.async_take(str(root / f"step_{i}"), app)
            return pending.wait, pending.done
        return save_async
    if method == "dcp_save":
        return lambda i: written(dcp.save(dcp_state(model, optim), checkpoint_id=str(root / f"step_{i}")))
    if method == "dcp_async_save":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # DCP's own staging, reused across saves; pinned memory and non-blocking copies need CUDA.
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                             use_non_blocking_copy=False))

        def save_dcp(i: int) -> tuple[Callable[[], None], Callable[[], bool]]:
            response = dcp.async_save(dcp_state(model, optim), checkpoint_id=str(root / f"step_{i}"),
                                      async_stager=stager)
            response.staging_completion.result()  # the state may change only once it is staged
            return response.upload_completion.result, response.upload_completion.done
        return save_dcp
    raise ValueError(f"unknown method {method!r}; one of {', '.join(METHODS)}")


def measure(method: str, root: Path, size_bytes: int, saves: int, device: str, window_s: float) -> dict:
    """In this (child) process: one first save, then ``saves`` more, each timed; then the steps'
    slowdown while more are written (:func:`slowdown`)."""
    dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)
    model, optim = build_state(size_bytes, seed=1)
    if device != "cpu":  # the state lives on the accelerator: saving includes the device-to-host copy
        model.to(device)
        for state in optim.state.values():
            state.update({k: v.to(device) for k, v in state.items()})
    save = saver(method, root, model, optim)
    blocking, done, durable = [], [], []
    for i in range(saves + 1):
        shutil.rmtree(root / f"step_{i}", ignore_errors=True)
        os.sync()  # no dirty pages of an earlier save (or method) left to slow this one's write-back
        started = time.perf_counter()
        wait, _ = save(i + 1)
        blocking.append(time.perf_counter() - started)
        wait()
        done.append(time.perf_counter() - started)
        if not FSYNCS[method]:
            fsync_tree(root / f"step_{i + 1}")
        durable.append(time.perf_counter() - started)
    return {"state_bytes": state_bytes(model, optim), "first_blocking_s": blocking[0], "first_durable_s": durable[0],
            "blocking_s": statistics.median(blocking[1:]), "done_s": statistics.median(done[1:]),
            "durable_s": statistics.median(durable[1:]),
            **slowdown(model, optim, save, saves + 2, root, device, window_s)}


def slowdown(model: Any, optim: Any, save: Save, first: int, root: Path, device: str, window_s: float) -> dict:
    """Training steps with no save in flight, and while background saves ``first``, ``first`` + 1,
    ... are written back to back, in :data:`SLOWDOWN_WINDOWS` alternating windows of ``window_s``
    each (quiet first); the median step of each kind. A save is removed once the next one is done."""
    batch = torch.randn(BATCH, WIDTH, device=device)

    def step() -> float:
        started = time.perf_counter()
        optim.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()
        optim.step()
        return time.perf_counter() - started

    step()  # gradients allocated
    quiet: list[float] = []
    during: list[float] = []
    index = first
    for _ in range(SLOWDOWN_WINDOWS):
        end = time.perf_counter() + window_s
        while time.perf_counter() < end:
            quiet.append(step())
        end = time.perf_counter() + window_s
        wait, finished = save(index)
        if finished():  # the method wrote before it returned: nothing in flight to slow the steps
            wait()
            return {"quiet_step_s": statistics.median(quiet), "quiet_steps": len(quiet), "steps_during_writes": 0,
                    "slowdown": None}
        while time.perf_counter() < end:
            if finished():
                wait()
                shutil.rmtree(root / f"step_{index - 1}", ignore_errors=True)
                index += 1
                wait, finished = save(index)
            during.append(step())
        wait()
        shutil.rmtree(root / f"step_{index - 1}", ignore_errors=True)
        index += 1
    return {"quiet_step_s": statistics.median(quiet), "quiet_steps": len(quiet), "steps_during_writes": len(during),
            "slowdown": statistics.median(during) / statistics.median(quiet)}


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path``, and ``path``'s parent."""
    for folder, _, files in os.walk(path):
        for name in [*files, "."]:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MethodFailed(Exception):
    """A method's process failed; the message is the end of its error output."""


def run_child(args: argparse.Namespace, method: str, root: Path) -> dict:
    """One process of ``method``: its measurement, or MethodFailed."""
    root.mkdir(parents=True)
    try:
        out = subprocess.run([sys.executable, __file__, "--size-gb", str(args.size_gb), "--saves", str(args.saves),
                              "--device", args.device, "--slowdown-window-s", str(args.slowdown_window_s),
                              "--child", method, str(root)],
                             capture_output=True, text=True, check=True)
    except subprocess.CalledProcessError as exc:
        raise MethodFailed(exc.stderr[-4000:]) from None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict], fsyncs: bool) -> dict:
    result: dict[str, Any] = {"fsyncs": fsyncs}
    for key in ("blocking_s", "done_s", "durable_s", "first_blocking_s", "first_durable_s", "quiet_step_s", "slowdown"):
        values = [r[key] for r in runs if r[key] is not None]
        result[key] = statistics.median(values) if values else None
        result[f"{key}_range"] = [min(values), max(values)] if values else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the methods (processes per method)")
    parser.add_argument("--saves", type=int, default=2, help="steady-state saves per process, after the first")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the local disk)")
    parser.add_argument("--device", default="cpu", help="where the state lives (cuda: pinned staging)")
    parser.add_argument("--slowdown-window-s", type=float, default=20.0,
                        help="length of each quiet and each saving window of the slowdown measurement")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    size_bytes = int(args.size_gb * 1e9)
    if args.child:
        print(json.dumps(measure(args.child[0], Path(args.child[1]), size_bytes, args.saves, args.device,
                                 args.slowdown_window_s)))
        return
    methods = args.methods.split(",")
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="torchrevive-bench-save-") as tmp:
        for round_ in range(args.repeats):
            for method in methods[round_ % len(methods):] + methods[:round_ % len(methods)]:
                if method in failed:
                    continue
                try:
                    run = run_child(args, method, Path(tmp) / f"{method}-{round_}")
                except MethodFailed as exc:
                    failed[method] = str(exc)
                    print(f"round {round_}  {method:26s} failed, left out of the later rounds:\n{exc}", flush=True)
                    continue
                runs[method].append(run)
                shown = "-" if run["slowdown"] is None else f"{run['slowdown']:.2f}x"
                print(f"round {round_}  {method:26s} blocking {run['blocking_s']:6.3f} s (first "
                      f"{run['first_blocking_s']:6.3f})   durable {run['durable_s']:6.3f} s   steps meanwhile "
                      f"{shown}", flush=True)
    measured = {m: r for m, r in runs.items() if r}
    if not measured:
        raise SystemExit("every method failed")
    size = next(iter(measured.values()))[0]["state_bytes"]
    results = {m: summarize(r, FSYNCS[m]) for m, r in measured.items()}
    report: dict[str, Any] = {"size_bytes": size, "machine": machine(), "device": args.device,
                              "repeats": args.repeats, "saves": args.saves,
                              "slowdown_windows": SLOWDOWN_WINDOWS, "slowdown_window_s": args.slowdown_window_s,
                              "date": time.strftime("%Y-%m-%d"), "results": results, "failed": failed}
    if "torchrevive" in results:
        ours = results["torchrevive"]
        report["torchrevive_blocking_s_per_gb"] = ours["blocking_s"] / (size / 1e9)
        report["ratios"] = {f"torchrevive_blocking_vs_{m}": ours["blocking_s"] / r["blocking_s"]
                            for m, r in results.items() if m != "torchrevive"}
        report["ratios"].update({f"torchrevive_durable_vs_{m}": ours["durable_s"] / r["durable_s"]
                                 for m, r in results.items() if m != "torchrevive"})
    print(f"\n{'method':26s} {'blocking s':>10s} {'first s':>8s} {'done s':>8s} {'durable s':>9s} {'slowdown':>8s}  "
          f"fsync   ({size / 1e9:.2f} GB, median of {args.repeats})")
    for method, r in results.items():
        shown = "-" if r["slowdown"] is None else f"{r['slowdown']:.2f}x"
        print(f"{method:26s} {r['blocking_s']:10.3f} {r['first_blocking_s']:8.3f} {r['done_s']:8.3f} "
              f"{r['durable_s']:9.3f} {shown:>8s}  {'yes' if r['fsyncs'] else 'no (fsync added)'}")
    for name, ratio in report.get("ratios", {}).items():
        print(f"{name:45s} {ratio:6.3f}x")
    for method in failed:
        print(f"{method}: failed (its error is in the JSON's \"failed\")")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
