"""examples/classic_train.py's job under NVIDIA's nvidia-resiliency-ext 0.4.1 (`ft_launcher`,
scripts/harness/nvrx_cluster.py): that script's training (the same model, Adam, data per step, marks and
flags; rank 0 `torch.save`s the whole state every --interval-steps and on every (re)start
`torch.load`s it and broadcasts every tensor), plus nvrx's fault-tolerance client as its heartbeats guide recommends
(docs/source/fault_tolerance/integration/heartbeats.rst, examples/fault_tolerance/basic_ft_example.py):

1. ``RankMonitorClient.init_workload_monitoring()`` on every rank, right after the process group;
2. ``send_heartbeat()`` after every step;
3. ``calculate_and_set_hb_timeouts()`` (a collective: the longest observed intervals, max over ranks,
   x the safety factor) once the heartbeats have spanned a checkpoint save ("heartbeats are not
   sent during checkpoint loading and saving"), i.e. at the step after each (re)start's first save.
The guide's optional steps that keep calculated timeouts for the next run (``state_dict()`` saved,
``load_state_dict()`` at start) are left out: the initial timeout they carry is learned from a
start with no checkpoint to load, and a restart that loads and broadcasts one can outlast it (seen
on 2 busy cores: a 9 s timeout, a restart's 8.8 s to its first heartbeat); a rank killed for that
would meet the same timeout at every further restart. So every (re)start heartbeats under
ft_launcher's fixed timeouts (scripts/harness/nvrx_cluster.py) until it has calculated its own.

Runs from the peers' environment: plain torch, nvrx and the examples only.
"""

from __future__ import annotations

import os
import sys

import nvidia_resiliency_ext.fault_tolerance as ft
import torch.distributed as dist

from examples.classic_train import parse_args, train


def main() -> None:
    args = parse_args(__doc__)
    dist.init_process_group("gloo")
    client = ft.RankMonitorClient()
    client.init_workload_monitoring()
    first_save: int | None = None
    """This (re)start's first saved step."""

    def heartbeat(step: int) -> None:
        nonlocal first_save
        client.send_heartbeat()
        if first_save is not None and step == first_save + 1:  # the intervals seen span a save
            client.calculate_and_set_hb_timeouts()
            if dist.get_rank() == 0:
                print(f"nvrx heartbeat timeouts: {client.hb_timeouts}", flush=True)
        if first_save is None and step % args.interval_steps == 0:
            first_save = step

    train(args, after_step=heartbeat)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    sys.stdout.flush()
    os._exit(0)  # see examples/worker_process.py: torch 2.13's gloo destructor can deadlock
