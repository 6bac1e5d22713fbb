"""`torchrevive` entry point: dispatches to the sub-commands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from agent.config import ConfigError, json_schema, recovery_timeouts
from agent.errors import TorchreviveError
from agent.timeouts import describe as describe_timeouts
from launcher.status_command import status_command
from launcher.torchrun_flags import parse_run_args

USAGE = """usage: torchrevive COMMAND [ARGS...]

commands:
  run      launch an elastic training job; accepts every torchrun flag, plus --config job.yaml
           (torchrevive run --help lists them)
  inspect  PATH: what a snapshot holds (step, world size, size, tensors by dtype, committed)
  verify   PATH: check every byte of a snapshot against its checksums (exit 1 at the first bad one)
  list     DIR: the snapshots of a checkpoint directory and their state (committed, uncommitted,
           incomplete, quarantined: found damaged at a restore and set aside, with the reason)
  report   EVENT_LOG: what happened to a job (rounds, recoveries by phase, saves, what went wrong),
           from its event log (observability.event_log); --json for the figures, --plot out.svg for
           its timeline as a picture
  status   a running job now, from its rendezvous: round, members, waiting and spare nodes, each
           tier's newest snapshot, last recoveries; --config job.yaml or run's --rdzv-* flags,
           --watch SECONDS, --json
  schema   the JSON Schema of a job config file, for a YAML editor to complete and check it

Replace `torchrun` with `torchrevive run` in any launch command.
"""


@record
def run_command(argv: Sequence[str]) -> int:
    """`torchrevive run`: resolve the job config and launch it with the recovery agent."""
    try:
        request = parse_run_args(argv)
    except ConfigError as exc:
        print(f"torchrevive run: error: {exc}", file=sys.stderr)
        return 2
    if request.print_config:
        print(request.config.to_yaml(), end="")
        timeouts = recovery_timeouts(request.config)
        if timeouts is not None:
            print(describe_timeouts(timeouts), end="")
        return 0
    # Imported here so that --help and --print-config stay fast.
    from launcher.launch import launch

    try:
        launch(request)
    except TorchreviveError as exc:  # the agent could not start or go on: what and why, in one line
        print(f"torchrevive run: error: {exc}", file=sys.stderr)
        return 1
    return 0


def inspect_command(argv: Sequence[str]) -> int:
    """`torchrevive inspect PATH`."""
    parser = argparse.ArgumentParser(prog="torchrevive inspect", description="Summarize a snapshot.")
    parser.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    from agent.checkpoint.inspect import summarize

    try:
        summary = summarize(args.path)
    except TorchreviveError as exc:
        print(f"torchrevive inspect: error: {exc}", file=sys.stderr)
        return 1
    print(f"snapshot    {summary.path}")
    print(f"step        {summary.step if summary.step is not None else '-'}")
    print(f"committed   {'yes' if summary.committed else 'no (Checkpointer.latest() skips it; agent.restore still reads it)'}")
    print(f"written at  world size {summary.world_size}")
    print(f"size        {_human(summary.size_bytes)}")
    checksums = f"yes ({summary.checksummed_files} files)" if summary.checksummed_files is not None else "no"
    print(f"checksums   {checksums}")
    print(f"tensors     {sum(summary.tensors_by_dtype.values())} ({summary.sharded_tensors} sharded, "
          f"{summary.replicated_tensors} replicated), {summary.objects} pickled objects")
    for dtype, count in sorted(summary.tensors_by_dtype.items()):
        print(f"  {dtype:12s} {count:6d} tensors  {_human(summary.bytes_by_dtype[dtype]):>10s}")
    return 0


def verify_command(argv: Sequence[str]) -> int:
    """`torchrevive verify PATH`."""
    parser = argparse.ArgumentParser(prog="torchrevive verify",
                                     description="Check a snapshot's files and every byte against its checksums.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--threads", type=int, default=4, help="hashing threads (default 4)")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    from agent.checkpoint.verify import check_snapshot

    def set_total(nbytes: int) -> None:
        bar.total = nbytes
        bar.refresh()

    try:
        with tqdm(unit="B", unit_scale=True, desc="verify", file=sys.stderr, disable=None) as bar:
            report = check_snapshot(args.path, threads=args.threads, progress=bar.update, on_total=set_total)
    except TorchreviveError as exc:
        print(f"torchrevive verify: error: {exc}", file=sys.stderr)
        return 1
    if not report.checksummed:
        print(f"{args.path}: structure ok ({report.files} files present and long enough); no checksum record "
              "(not committed by torchrevive's Checkpointer), so the bytes were not checked")
    else:
        print(f"{args.path}: ok, {report.files} files, {_human(report.bytes_checked)} checked")
    return 0


def list_command(argv: Sequence[str]) -> int:
    """`torchrevive list DIR`."""
    parser = argparse.ArgumentParser(prog="torchrevive list", description="List the snapshots of a checkpoint dir.")
    parser.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    from agent.checkpoint.dirs import list_partial, list_quarantined, list_snapshots
    from agent.checkpoint.inspect import summarize
    from agent.checkpoint.quarantine import quarantine_reason

    partial, quarantined = list_partial(args.dir), list_quarantined(args.dir)
    snapshots = sorted(list_snapshots(args.dir) + partial + quarantined)
    if not snapshots:
        print(f"{args.dir}: no step_<N> snapshots")
        return 0
    print(f"{'step':>8s}  {'state':11s}  {'world':>5s}  {'size':>10s}  path")
    for step, path in snapshots:
        state, world, size = "incomplete", "-", "-"  # a save being written, or a dead one's leftover
        if (step, path) not in partial:
            try:
                summary = summarize(path)
                state = "committed" if summary.committed else "uncommitted"
                world, size = str(summary.world_size), _human(summary.size_bytes)
            except TorchreviveError:
                pass
        if (step, path) in quarantined:
            state = "quarantined"  # damaged: no restore picks it; kept as evidence
        print(f"{step:8d}  {state:11s}  {world:>5s}  {size:>10s}  {path}")
        if state == "quarantined":
            print(f"{'':8s}  reason: {quarantine_reason(path) or 'not recorded'}")
    return 0


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def report_command(argv: Sequence[str]) -> int:
    """`torchrevive report EVENT_LOG`."""
    parser = argparse.ArgumentParser(prog="torchrevive report",
                                     description="What happened to a job, from its event log (finished or running).")
    parser.add_argument("event_log", type=Path)
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    parser.add_argument("--plot", type=Path, metavar="OUT.svg", help="also draw the job's timeline as an SVG")
    args = parser.parse_args(argv)
    from agent.events import read_events
    from agent.report import job_report, render
    from agent.report_plot import draw_timeline

    try:
        events = read_events(args.event_log)
        report = job_report(events)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"torchrevive report: error: {args.event_log}: {why}", file=sys.stderr)
        return 1
    if args.plot is not None:
        try:
            args.plot.write_text(draw_timeline(events))
        except OSError as exc:
            print(f"torchrevive report: error: {args.plot}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    print(json.dumps(report, indent=2) if args.json else render(report), end="\n" if args.json else "")
    return 0


def schema_command(argv: Sequence[str]) -> int:
    """`torchrevive schema`."""
    parser = argparse.ArgumentParser(
        prog="torchrevive schema",
        description="Print the JSON Schema of a job config file (YAML editors complete and check the file with it).")
    parser.parse_args(argv)
    print(json.dumps(json_schema(), indent=2))
    return 0


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "run": run_command,
    "inspect": inspect_command,
    "verify": verify_command,
    "list": list_command,
    "report": report_command,
    "status": status_command,
    "schema": schema_command,
}


def main(argv: Sequence[str] | None = None) -> None:
    """Console script `torchrevive`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        sys.exit(0 if args else 2)
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"torchrevive: unknown command '{args[0]}'\n\n{USAGE}", end="", file=sys.stderr)
        sys.exit(2)
    sys.exit(command(args[1:]))


if __name__ == "__main__":
    main()
