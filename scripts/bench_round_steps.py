"""Step time of the compiled GPT on K nodes with in-process rounds on and off, runs interleaved: is
a worker that stayed in its process across rounds as fast as a restarted one?

    python scripts/bench_round_steps.py --fault kill-rejoin --runs 2 --json out.json

Each run starts K `torchrevive run` agents (examples/gpt/train.py, storage snapshots every
--interval-steps) and, with --fault kill-rejoin, kills the last node after 10 steps at the full
world and starts it again once the others trained 3 steps without it. Figures are the medians of
rank 0's steps at the full world (before the fault, and after the rejoin), save steps apart: a
step that took more than --save-step-s.
JSON: {"runs": [{"in_process", "before_s", "after_s", "save_steps_after_s", "steps_after"}], ...}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

from agent.events import read_events
from harness.bench_state import machine
from harness.nodes import Cluster
from harness.ports import free_port


def steps_at(marks: list[dict], world: int, after: float = 0.0) -> list[dict]:
    return [m for m in marks if m["event"] in ("step", "first_step_done") and m.get("world_size") == world
            and m["time"] > after]


def step_gaps(marks: list[dict], world: int, after: float) -> list[float]:
    """Seconds between two consecutive steps of rank 0, both at ``world``, after ``after``; the first
    two left out (a round's first steps)."""
    ordered = sorted(steps_at(marks, world, after), key=lambda m: m["time"])
    return [q["time"] - p["time"] for p, q in zip(ordered, ordered[1:])
            if q["event"] == "step" and q["step"] == p["step"] + 1][2:]


def run(args: argparse.Namespace, in_process: bool, work: Path) -> dict:
    options = argparse.Namespace(
        nodes=args.nodes, nproc_per_node=1, backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", state_mb=4,
        interval_steps=args.interval_steps, memory_interval=0, timeout=600, workload="gpt", gpt_size=args.gpt_size,
        compile="on", in_process=in_process)
    work.mkdir()
    cluster, last, back = Cluster(options, work), args.nodes - 1, 0.0
    try:
        cluster.start_all(args.nodes)
        cluster.wait_for(lambda m: len(steps_at(m, args.nodes)) >= 10, 600, "10 steps", path=cluster.marks)
        if args.fault == "kill-rejoin":
            killed = time.time()
            cluster.kill(last)
            cluster.wait_for(lambda m: len(steps_at(m, last, killed)) >= 3, 600, "3 steps without it", path=cluster.marks)
            back = time.time()
            cluster.start(last)
        cluster.wait_for(lambda m: len(steps_at(m, args.nodes, back)) >= args.steps, 600, f"{args.steps} steps",
                         path=cluster.marks)
    finally:
        cluster.stop()
    marks = read_events(cluster.marks)
    before = [g for g in step_gaps(marks, args.nodes, 0.0) if g < args.save_step_s]
    after = step_gaps(marks, args.nodes, back)
    plain, saves = [g for g in after if g < args.save_step_s], [g for g in after if g >= args.save_step_s]
    return {"in_process": in_process, "before_s": statistics.median(before), "after_s": statistics.median(plain),
            "save_steps_after_s": statistics.median(saves) if saves else None, "steps_after": [round(g, 3) for g in after]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpt-size", default="default")
    parser.add_argument("--fault", choices=("none", "kill-rejoin"), default="kill-rejoin")
    parser.add_argument("--runs", type=int, default=2, help="runs of each mode, interleaved")
    parser.add_argument("--steps", type=int, default=18, help="steps at the full world measured (after the rejoin)")
    parser.add_argument("--interval-steps", type=int, default=5)
    parser.add_argument("--save-step-s", type=float, default=4.5, help="a step this long or longer is a save step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="torchrevive-round-steps-") as work:
        for index in range(args.runs):
            for in_process in (True, False):
                runs.append(run(args, in_process, Path(work) / f"{index}-{in_process}"))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "steps_after"}), flush=True)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "args": vars(args), "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
