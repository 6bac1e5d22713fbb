"""A worker for end-to-end tests: it joins the job's gloo process group and all-reduces in a loop
until ``OUT/stop`` exists (all ranks stop at the same step), then exits 0.

It writes ``OUT/ready<RANK>`` (JSON: pid, restart count, the environment variables named by
``--env``, the job config file's text) once the group formed, appends ``step time`` to
``OUT/progress<RANK>`` about every 0.2 s, and with ``--record-signal SIG`` writes the name of that
signal to ``OUT/signal<RANK>`` when it arrives, and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--env", nargs="*", default=[])
    parser.add_argument("--record-signal", default=None)
    args = parser.parse_args()
    rank = os.environ["RANK"]
    if args.record_signal:
        def record(signum: int, frame: object) -> None:
            (args.out / f"signal{rank}").write_text(signal.Signals(signum).name)
            sys.exit(0)

        signal.signal(getattr(signal, args.record_signal), record)
    dist.init_process_group("gloo")
    config = os.environ.get("TORCHREVIVE_CONFIG")
    (args.out / f"ready{rank}").write_text(json.dumps({
        "pid": os.getpid(), "restart": os.environ["TORCHELASTIC_RESTART_COUNT"],
        "env": {name: os.environ.get(name) for name in args.env},
        "config": Path(config).read_text() if config else None,
    }))
    step, logged = 0, 0.0
    with (args.out / f"progress{rank}").open("a") as progress:
        while True:
            flag = torch.tensor([float((args.out / "stop").exists())])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
            step += 1
            if time.time() - logged > 0.2:
                logged = time.time()
                progress.write(f"{step} {logged}\n")
                progress.flush()
            time.sleep(0.01)
    dist.barrier()
    # No teardown: gloo's destructors can abort (SIGABRT) when peers exit at the same moment.
    os._exit(0)


if __name__ == "__main__":
    main()
