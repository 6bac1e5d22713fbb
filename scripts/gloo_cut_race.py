"""How often a gloo collective hangs when a rank cuts its round's connections while it trains: both
sides at once (``SHUT_RDWR``) against the reading side first
(``agent.round_sockets.RoundConnections.cut``).

Each trial runs two ranks that all-reduce in a loop; after 0.3-0.5 s a thread of rank 1 cuts its
connections, as the leave watcher of ``agent.run_resilient`` does. A trial hangs when rank 1's
collective has not failed within ``--wait-s``: gloo lost its send and waits for the group's
timeout. ``--busy`` processes spin meanwhile (the race needs a loaded machine).

    .venv/bin/python scripts/gloo_cut_race.py --trials 12 --busy 3 --json gloo_cut_race.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.ports import free_port  # noqa: E402

MODES = {"both_at_once": "SHUT_RDWR at once", "reading_first": "agent.round_sockets.RoundConnections.cut"}


def _rank(rank: int, port: int, mode: str, seed: int, left: multiprocessing.Event) -> None:
    import torch
    import torch.distributed as dist

    from agent.round_sockets import RoundConnections, open_sockets

    connections = RoundConnections(open_sockets())
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    tensor = torch.ones(200_000)

    def cut() -> None:
        time.sleep(0.3 + random.Random(seed).random() * 0.2)
        if mode == "both_at_once":
            connections.shut(socket.SHUT_RDWR)
        else:
            connections.cut()

    if rank == 1:
        threading.Thread(target=cut, daemon=True).start()
    try:
        while True:
            dist.all_reduce(tensor)
    except Exception:  # noqa: BLE001 - the cut ended the collective, as it should
        if rank == 1:
            left.set()
    os._exit(0)


def _spin() -> None:
    while True:
        pass


def trial(mode: str, seed: int, wait_s: float) -> bool:
    """Whether rank 1 left its collective within ``wait_s`` of the start."""
    context = multiprocessing.get_context("spawn")
    left = context.Event()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(r, port, mode, seed, left)) for r in (0, 1)]
    for process in ranks:
        process.start()
    done = left.wait(wait_s)
    for process in ranks:
        process.kill()
        process.join()
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=12, help="trials per way of cutting")
    parser.add_argument("--busy", type=int, default=3, help="processes that spin meanwhile")
    parser.add_argument("--wait-s", type=float, default=20.0, help="a trial hangs past this (from its start)")
    parser.add_argument("--json", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    spinners = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for spinner in spinners:
        spinner.start()
    try:
        results = {mode: {"how": how, "trials": args.trials,
                          "hung": sum(not trial(mode, seed, args.wait_s) for seed in range(args.trials))}
                   for mode, how in MODES.items()}
    finally:
        for spinner in spinners:
            spinner.kill()
    report = {"date": time.strftime("%Y-%m-%d"), "busy": args.busy, "cpus": os.cpu_count(), "results": results}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
