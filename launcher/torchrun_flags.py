"""torchrun's own flags, resolved against the job config.

The `run` parser *is* torchrun's parser (``torch.distributed.run.get_args_parser``) plus three
flags of ours, so every torchrun flag keeps its names, defaults and meaning by construction.
Each torchrun flag maps to one key of the job config; a value's precedence is

    command-line flag  >  PET_* environment variable  >  YAML file  >  default

and the resolved config is turned back into the namespace torchrun builds its LaunchConfig from.
"""

from __future__ import annotations

import argparse
import os
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed import run as torchrun
from torch.distributed.argparse_util import check_env, env

from agent import torch_private
from agent.config import (
    ConfigError,
    JobConfig,
    load_config,
    parse_override,
    rdzv_conf_for_torch,
    set_value,
    validate,
)

# torchrun's argparse dest -> job config key. Every torchrun flag is here (a test checks it
# against torch's parser), so YAML can say anything the command line can.
TORCHRUN_FLAG_KEYS: dict[str, str] = {
    "nnodes": "job.nnodes",
    "nproc_per_node": "job.nproc_per_node",
    "rdzv_id": "job.id",
    "max_restarts": "job.max_restarts",
    "monitor_interval": "job.monitor_interval",
    "role": "job.role",
    "rdzv_backend": "rendezvous.backend",
    "rdzv_endpoint": "rendezvous.endpoint",
    "rdzv_conf": "rendezvous.conf",
    "standalone": "rendezvous.standalone",
    "start_method": "launch.start_method",
    "event_log_handler": "launch.event_log_handler",
    "module": "launch.module",
    "no_python": "launch.no_python",
    "run_path": "launch.run_path",
    "log_dir": "launch.log_dir",
    "redirects": "launch.redirects",
    "tee": "launch.tee",
    "local_ranks_filter": "launch.local_ranks_filter",
    "duplicate_stdout_filters": "launch.duplicate_stdout_filters",
    "duplicate_stderr_filters": "launch.duplicate_stderr_filters",
    "node_rank": "launch.node_rank",
    "master_addr": "launch.master_addr",
    "master_port": "launch.master_port",
    "local_addr": "launch.local_addr",
    "logs_specs": "launch.logs_specs",
    "numa_binding": "launch.numa_binding",
    "signals_to_handle": "launch.signals_to_handle",
    "shutdown_timeout": "launch.shutdown_timeout",
    "virtual_local_rank": "launch.virtual_local_rank",
}
SCRIPT_DESTS = ("training_script", "training_script_args")
OWN_DESTS = ("config", "print_config", "overrides")


@dataclass(frozen=True)
class RunRequest:
    """A parsed `torchrevive run` command line: the resolved job and what to run."""

    config: JobConfig
    config_path: str | None
    script: str | None
    script_args: list[str]
    print_config: bool


def build_run_parser() -> argparse.ArgumentParser:
    """torchrun's parser, renamed, with --config, --print-config and --set added."""
    parser = torchrun.get_args_parser()
    parser.prog = "torchrevive run"
    parser.description = (
        "Launch an elastic training job like torchrun, with torchrevive's recovery agent. "
        "Every torchrun flag is accepted with torchrun's meaning."
    )
    own = parser.add_argument_group("torchrevive")
    own.add_argument("--config", metavar="PATH", default=None, help="YAML job config (see configs/).")
    own.add_argument("--print-config", action="store_true", help="Print the resolved job config as YAML and exit.")
    own.add_argument(
        "--set",
        dest="overrides",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        help="Override one job config key, e.g. --set checkpoint.keep=5 (repeatable).",
    )
    # The script may be left out when only printing the config; run() checks it otherwise.
    _action(parser, "training_script").nargs = "?"
    return parser


def parse_run_args(argv: Sequence[str]) -> RunRequest:
    """Parse and resolve a `torchrevive run` command line (without the word `run`)."""
    parser = build_run_parser()
    args = parser.parse_args(argv)
    if args.training_script is None and not args.print_config:
        parser.error("the following arguments are required: training_script")
    explicit = _explicit_dests(argv)
    sources: dict[str, str] = {}
    config = load_config(args.config, sources)

    for dest, key in TORCHRUN_FLAG_KEYS.items():
        action = _action(parser, dest)
        env_name = f"PET_{dest.upper()}"
        if dest in explicit:
            source = next(s for s in action.option_strings if s.startswith("--"))
        elif isinstance(action, (env, check_env)) and env_name in os.environ:
            source = f"environment {env_name}"
        else:
            continue
        _apply_flag(config, dest, key, getattr(args, dest), source, sources)
    for assignment in args.overrides:
        key, value = parse_override(assignment)
        set_value(config, key, value, source=f"--set {assignment}")
        sources[key] = f"--set {assignment}"
        if key == "rendezvous.conf":  # the whole mapping replaced: each of its keys comes from here now
            for stale in [k for k in sources if k.startswith(f"{key}.")]:
                del sources[stale]
            sources.update({f"{key}.{name}": f"--set {assignment}" for name in config.rendezvous.conf})
    validate(config, sources)
    return RunRequest(
        config=config,
        config_path=args.config,
        script=args.training_script,
        script_args=list(args.training_script_args),
        print_config=args.print_config,
    )


def torchrun_namespace(config: JobConfig, script: str, script_args: Sequence[str]) -> argparse.Namespace:
    """The namespace torchrun's parser would produce for this job, after torchrun's own implicit
    rules (--standalone, and single-node static jobs on a local c10d store)."""
    values: dict[str, Any] = {dest: config.get(key) for dest, key in TORCHRUN_FLAG_KEYS.items()}
    values["nnodes"] = str(values["nnodes"])
    values["nproc_per_node"] = str(values["nproc_per_node"])
    values["rdzv_conf"] = ",".join(f"{k}={v}" for k, v in rdzv_conf_for_torch(config.rendezvous.conf).items())
    ns = argparse.Namespace(**values, training_script=script, training_script_args=list(script_args))
    if ns.standalone or (
        ns.rdzv_backend == "static" and not ns.rdzv_endpoint and ns.master_port is None and config.min_max_nodes[1] == 1
    ):
        ns.rdzv_backend = "c10d"
        ns.rdzv_endpoint = "localhost:0"
        ns.rdzv_id = str(uuid.uuid4())
    if ns.master_port is None:
        ns.master_port = 29500
    return ns


def _apply_flag(config: JobConfig, dest: str, key: str, value: Any, source: str, sources: dict[str, str]) -> None:
    """Set the key of one torchrun flag and record where it came from (for --rdzv-conf, each of its
    keys: an unknown key from a flag is only a warning)."""
    sources[key] = source
    if dest == "rdzv_conf":
        try:
            parsed = torch_private.parse_rendezvous_config(value)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from exc
        if "password" in parsed and source.startswith("--"):
            warnings.warn(f"{source}: a password on the command line is visible to every user of this machine "
                          "(ps); name a file holding it with password_file, or set TORCHREVIVE_ETCD_PASSWORD",
                          stacklevel=2)
        # Flag keys win over YAML keys one by one, so a flag can change one timeout.
        value = {**config.rendezvous.conf, **parsed}
        sources.update({f"{key}.{name}": source for name in parsed})
    elif dest == "nproc_per_node" and isinstance(value, str) and value.isdigit():
        value = int(value)
    set_value(config, key, value, source=source)


def _explicit_dests(argv: Sequence[str]) -> set[str]:
    """The dests given on the command line itself (not defaults, not PET_* variables)."""
    parser = build_run_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    # argparse has no public lookup of an action by dest.
    return next(a for a in parser._actions if a.dest == dest)
