"""`torchrevive status`: its command line and its refresh loop.

The job is named as for `torchrevive run`, by the run command's own parser and config resolution
(--config job.yaml, --rdzv-backend, --rdzv-endpoint, --rdzv-id, --rdzv-conf, --set, PET_*
variables), so the command line or config that launched a job also finds it; --watch, --json and
--timeout are status's own.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence

from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from agent.config import ConfigError, JobConfig, rdzv_conf_for_torch
from agent.rendezvous.state_reader import BACKENDS, RendezvousUnreachable, open_reader
from launcher.torchrun_flags import parse_run_args

DEFAULT_TIMEOUT_S = 5.0
DESCRIPTION = """\
A running job's round, members, waiting and spare nodes, each tier's newest snapshot and its last
recoveries, read from its rendezvous (read-only).

The job is named as for `torchrevive run` (the same flags, config and PET_* variables):
  --config job.yaml               its config: the rendezvous, checkpoint.dir, observability.event_log
  --rdzv-backend c10d|etcd3       the rendezvous backend
  --rdzv-endpoint HOST:PORT       c10d: the node hosting the store; etcd3: HOST:PORT[,HOST:PORT...]
  --rdzv-id JOB                   the job's rendezvous id
  --rdzv-conf KEY=VALUE,...       e.g. etcd3's ca_cert, user, password_file, key_prefix
  --set SECTION.KEY=VALUE         one config key, e.g. --set checkpoint.dir=/ckpt
"""


def parse_status_args(argv: Sequence[str]) -> tuple[argparse.Namespace, JobConfig]:
    """status's own flags, and the job resolved from the rest as `run` resolves it; ConfigError
    for a job that names no rendezvous to read."""
    parser = argparse.ArgumentParser(prog="torchrevive status", allow_abbrev=False, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--watch", type=float, metavar="SECONDS", default=None,
                        help="refresh every SECONDS until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="the status as JSON (one object a line with --watch)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", default=DEFAULT_TIMEOUT_S,
                        help=f"how long to wait for the rendezvous to answer (default {DEFAULT_TIMEOUT_S:.0f})")
    args, job_argv = parser.parse_known_args(argv)
    if args.watch is not None and args.watch <= 0:
        parser.error("--watch: give a positive number of seconds")
    # --print-config: the run parser's way of resolving a job without a training script.
    request = parse_run_args([*job_argv, "--print-config"])
    if request.script is not None:
        raise ConfigError(f"unexpected argument {request.script!r}: status takes no training script")
    rendezvous = request.config.rendezvous
    if rendezvous.standalone or not rendezvous.endpoint:
        raise ConfigError("status reads a job's rendezvous: give --rdzv-endpoint HOST:PORT (or rendezvous.endpoint "
                          "in --config); a --standalone job's endpoint is its own, unknown to others")
    if rendezvous.backend not in BACKENDS:
        raise ConfigError(f"rendezvous backend {rendezvous.backend!r} keeps no state to read: status reads "
                          f"{', '.join(BACKENDS)} (give --rdzv-backend, or rendezvous.backend in --config)")
    return args, request.config


def status_command(argv: Sequence[str]) -> int:
    """`torchrevive status`."""
    try:
        args, job = parse_status_args(argv)
    except ConfigError as exc:
        print(f"torchrevive status: error: {exc}", file=sys.stderr)
        return 2
    # Imported here so that --help and every other command stay fast (it imports the agent's parts).
    from agent.status import job_status, render

    # Ctrl-C ends a watch between two refreshes: a flag, not an exception raised wherever the
    # signal lands (inside a store call, or while the interpreter exits).
    stopped = threading.Event()
    signal.signal(signal.SIGINT, lambda signum, frame: stopped.set())
    reader = None
    while not stopped.is_set():
        try:
            if reader is None:
                reader = open_reader(job.rendezvous.backend, job.rendezvous.endpoint, job.job.id,
                                     rdzv_conf_for_torch(job.rendezvous.conf), timeout_s=args.timeout)
            status = job_status(job, reader)
        except (RendezvousUnreachable, RendezvousStateError, ValueError) as exc:
            print(f"torchrevive status: error: {exc}", file=sys.stderr, flush=True)
            if args.watch is None or (reader is None and isinstance(exc, ValueError)):  # options that never hold
                return 1
            reader = None  # a store host that went away: connect again at the next refresh
        else:
            if args.json:
                print(json.dumps(status, indent=None if args.watch else 2), flush=True)
            else:
                print(render(status), end="" if args.watch is None else "\n", flush=True)
        if args.watch is None:
            return 0
        stopped.wait(args.watch)
    return 0
