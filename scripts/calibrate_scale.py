"""Checks scripts/simulate_scale.py's model against this machine: the model, given parameters
measured here independently of the methods it predicts (storage read speeds from the raw-read
column of the restore benchmark, one reader stream and a worker start measured by this script,
the rendezvous settings of the harness), predicts the restore benchmark's and the fault harness's
measurements.

    python scripts/calibrate_scale.py --json out.json

Reads docs/results/bench_restore_2gb.json and docs/results/cluster_{kill,freeze}_4x1_512mb.json
(rerun scripts/bench_restore.py and scripts/local_cluster.py to refresh them). Recovery rows leave
out the first training step (a property of the model being trained, not of recovery).
JSON: {"rows": [{"what", "predicted_s", "measured_s"}], "max_rel_error", "parameters": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path

from simulate_scale import Assumptions, torchrevive

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"

WORKER_START = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    from agent import Checkpointer  # torchsnapshot, DTensor and DCP load, as in the example's workers
    from examples.train import build_model
    rank, world, port, width = map(int, sys.argv[1:5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # as the example starts when it resumes: no initializers, no broadcast (the restore sets the values)
    torch.nn.parallel.DistributedDataParallel(build_model(width, torch.device("cpu"), initialize=False), init_sync=False)
    print(time.time(), flush=True)
    import os; os._exit(0)
""")


def stream_read_gbps(size: int = 1 << 30, repeats: int = 3) -> float:
    """One reader, one sequential stream, cold: what `torch.load` of one file gets from storage
    (median of ``repeats``)."""
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR")) as f:
        block = os.urandom(16 << 20)
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        rates = []
        for _ in range(repeats):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            with open(f.name, "rb", buffering=0) as reader:
                while reader.read(16 << 20):
                    pass
            rates.append(size / (time.perf_counter() - start) / 1e9)
        return statistics.median(rates)


def first_touch_gbps(size: int = 1 << 30) -> float:
    """Filling freshly allocated memory (page faults included): what materializing a loaded
    checkpoint in new tensors costs, beside copying into existing ones."""
    import torch

    start = time.perf_counter()
    torch.empty(size, dtype=torch.uint8).fill_(1)
    return size / (time.perf_counter() - start) / 1e9


def worker_start_s(workers: int, width: int) -> float:
    """Start ``workers`` processes at once that import torch and torchrevive, join a gloo group and
    build the example model under DDP: until the last is ready."""
    from local_cluster import job_env
    from local_ports import free_port

    port, env = free_port(), job_env()
    start = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER_START, str(r), str(workers), str(port), str(width)],
                              stdout=subprocess.PIPE, text=True, env=env, cwd=REPO) for r in range(workers)]
    ready = [float(p.communicate(timeout=300)[0].split()[-1]) for p in procs]
    return max(ready) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", default=str(RESULTS / "bench_restore_2gb.json"))
    parser.add_argument("--cluster", default=str(RESULTS / "cluster_{}_4x1_512mb.json"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    bench = json.loads(Path(args.bench).read_text())
    results, size = bench["results"], bench["size_bytes"]
    raw_cold, raw_warm = results["raw_read"]["cold_gbps"], results["raw_read"]["warm_gbps"]
    stream, first_touch = stream_read_gbps(), first_touch_gbps()
    rows = [
        ("restore 2 GB, torchrevive, cold", size / (raw_cold * 1e9), results["torchrevive"]["cold_s"]),
        ("restore 2 GB, torchrevive, warm", size / (raw_warm * 1e9), results["torchrevive"]["warm_s"]),
        ("restore 2 GB, torchsnapshot, cold", size / (raw_cold * Assumptions.parallel_efficiency * 1e9),
         results["torchsnapshot"]["cold_s"]),
        # torch.load: read one stream into new tensors, then load_state_dict copies into the state.
        ("restore 2 GB, classic torch.load, cold", size / (stream * 1e9) + size / (first_touch * 1e9)
         + size / (raw_warm * 1e9), results["torch_load"]["cold_s"]),
    ]
    parameters = {"raw_read_cold_gbps": raw_cold, "raw_read_warm_gbps": raw_warm, "stream_read_gbps": stream,
                  "first_touch_gbps": first_touch}
    sys.path.insert(0, str(REPO / "scripts"))
    from local_cluster import width_for

    for failure, scenario in (("kill", "kill"), ("hang", "freeze")):
        run = json.loads(Path(args.cluster.format(scenario)).read_text())
        nodes, nproc = run["nodes"], run["nproc_per_node"]
        start = parameters.setdefault("worker_start_s", worker_start_s(nodes - 1, width_for(run["state_bytes"] / 1e6)))
        local = replace(Assumptions(), gpus=nodes * nproc, gpus_per_node=nproc, size_bytes=run["state_bytes"],
                        storage_aggregate_gbps=raw_cold, client_gbps=raw_cold, memory_gbps=raw_warm,
                        page_cache_warm=1.0, worker_start_s=start, rendezvous_s=0.5, failure=failure,
                        keep_alive_s=1.0, keep_alive_attempts=3, first_step_s=0.0)
        predicted = sum(torchrevive(local).values())
        phases = run["torchrevive"]["phases"]
        measured = run["torchrevive"]["recovery_s"] - phases["first_step"]
        rows.append((f"recovery after a {scenario}, {nodes} nodes x {nproc}, {run['state_bytes'] / 1e6:.0f} MB",
                     predicted, measured))
    report = {"rows": [{"what": w, "predicted_s": p, "measured_s": m} for w, p, m in rows],
              "max_rel_error": max(abs(p - m) / m for _, p, m in rows), "parameters": parameters}
    print(f"{'what':58s} {'predicted':>10s} {'measured':>10s} {'error':>7s}")
    for what, predicted, measured in rows:
        print(f"{what:58s} {predicted:9.2f}s {measured:9.2f}s {(predicted - measured) / measured:+7.0%}")
    print(f"max relative error {report['max_rel_error']:.0%}; parameters: "
          + ", ".join(f"{k} {v:.2f}" for k, v in parameters.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
