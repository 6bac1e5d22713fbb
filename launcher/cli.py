"""`torchrevive` entry point: dispatches to the sub-commands."""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from agent.config import ConfigError
from launcher.torchrun_flags import parse_run_args

USAGE = """usage: torchrevive COMMAND [ARGS...]

commands:
  run    launch an elastic training job; accepts every torchrun flag, plus --config job.yaml
         (torchrevive run --help lists them)

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
        return 0
    # Imported here so that --help and --print-config stay fast.
    from launcher.launch import launch

    launch(request)
    return 0


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"run": run_command}


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
