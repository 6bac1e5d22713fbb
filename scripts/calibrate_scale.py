"""Checks scripts/simulate_scale.py's model against this machine, both sides measured in one run:
the parameters the model is given (storage read speeds from the raw-read column of a restore
benchmark run now, one reader stream, filling new memory, a worker start, the rendezvous settings
of the harness) and the figures it predicts (that same restore run's torchrevive, torchsnapshot and
torch.load columns; a kill and a freeze in a local cluster run now).

    python scripts/calibrate_scale.py --json out.json

Recovery rows leave out the first training step (a property of the model being trained, not of
recovery). JSON: {"rows": [{"what", "predicted_s", "measured_s"}], "max_rel_error",
"parameters": {...}, "measured": {"restore": ..., "cluster": ...}}.
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


def restore_run(size_gb: float, repeats: int) -> dict:
    """scripts/bench_restore.py now, for the methods the rows compare and the raw read."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "restore.json"
        subprocess.run([sys.executable, str(REPO / "scripts" / "bench_restore.py"), "--size-gb", str(size_gb),
                        "--repeats", str(repeats), "--methods", "torchrevive,torchsnapshot,torch_load,raw_read",
                        "--json", str(out)], check=True, cwd=REPO, env=_job_env())
        return json.loads(out.read_text())


def cluster_run(nodes: int, state_mb: float) -> dict:
    """scripts/local_cluster.py now: a kill, then a freeze, in one job of ``nodes`` nodes x 1."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "cluster.json"
        subprocess.run([sys.executable, str(REPO / "scripts" / "local_cluster.py"), "--nodes", str(nodes),
                        "--scenario", "kill,freeze", "--state-mb", str(state_mb), "--json", str(out)],
                       check=True, cwd=REPO, env=_job_env())
        return json.loads(out.read_text())


def _job_env() -> dict[str, str]:
    from local_cluster import job_env

    return job_env()


def restore_rows(bench: dict, stream: float, first_touch: float) -> list[tuple[str, float, float]]:
    results, size = bench["results"], bench["size_bytes"]
    raw_cold, raw_warm = results["raw_read"]["cold_gbps"], results["raw_read"]["warm_gbps"]
    gb = size / 1e9
    return [
        (f"restore {gb:.1f} GB, torchrevive, cold", size / (raw_cold * 1e9), results["torchrevive"]["cold_s"]),
        (f"restore {gb:.1f} GB, torchrevive, warm", size / (raw_warm * 1e9), results["torchrevive"]["warm_s"]),
        (f"restore {gb:.1f} GB, torchsnapshot, cold", size / (raw_cold * Assumptions.parallel_efficiency * 1e9),
         results["torchsnapshot"]["cold_s"]),
        # torch.load: read one stream into new tensors, then load_state_dict copies into the state.
        (f"restore {gb:.1f} GB, classic torch.load, cold", size / (stream * 1e9) + size / (first_touch * 1e9)
         + size / (raw_warm * 1e9), results["torch_load"]["cold_s"]),
    ]


def recovery_rows(cluster: dict, bench: dict, start_s: float) -> list[tuple[str, float, float]]:
    raw = bench["results"]["raw_read"]
    rows = []
    for run, failure in zip(cluster["runs"], ("kill", "hang")):
        nodes, nproc = run["world_size_before"] // cluster["nproc_per_node"], cluster["nproc_per_node"]
        local = replace(Assumptions(), gpus=nodes * nproc, gpus_per_node=nproc, size_bytes=cluster["state_bytes"],
                        storage_aggregate_gbps=raw["cold_gbps"], client_gbps=raw["cold_gbps"],
                        memory_gbps=raw["warm_gbps"], page_cache_warm=1.0, worker_start_s=start_s, rendezvous_s=0.5,
                        failure=failure, keep_alive_s=1.0, keep_alive_attempts=3, first_step_s=0.0)
        predicted = sum(torchrevive(local).values())
        measured = run["recovery_s"] - run["phases"]["first_step"]
        scenario = "kill" if failure == "kill" else "freeze"
        rows.append((f"recovery after a {scenario}, {nodes} nodes x {nproc}, {cluster['state_bytes'] / 1e6:.0f} MB",
                     predicted, measured))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.0, help="the restore benchmark's state")
    parser.add_argument("--repeats", type=int, default=3, help="the restore benchmark's repeats")
    parser.add_argument("--nodes", type=int, default=4, help="the local cluster's nodes (one rank each)")
    parser.add_argument("--state-mb", type=float, default=512, help="the local cluster's training state")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from local_cluster import width_for

    stream, first_touch = stream_read_gbps(), first_touch_gbps()
    bench = restore_run(args.size_gb, args.repeats)
    cluster = cluster_run(args.nodes, args.state_mb)
    # The survivors of the kill start their workers: as many as the cluster has after it.
    start = worker_start_s(args.nodes - 1, width_for(args.state_mb))
    raw = bench["results"]["raw_read"]
    parameters = {"raw_read_cold_gbps": raw["cold_gbps"], "raw_read_warm_gbps": raw["warm_gbps"],
                  "stream_read_gbps": stream, "first_touch_gbps": first_touch, "worker_start_s": start}
    rows = restore_rows(bench, stream, first_touch) + recovery_rows(cluster, bench, start)
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_avg_1m_5m_15m": list(os.getloadavg()),
              "rows": [{"what": w, "predicted_s": p, "measured_s": m} for w, p, m in rows],
              "max_rel_error": max(abs(p - m) / m for _, p, m in rows), "parameters": parameters,
              "measured": {"restore": bench, "cluster": {k: cluster[k] for k in ("nodes", "state_bytes", "runs")}}}
    print(f"{'what':58s} {'predicted':>10s} {'measured':>10s} {'error':>7s}")
    for what, predicted, measured in rows:
        print(f"{what:58s} {predicted:9.2f}s {measured:9.2f}s {(predicted - measured) / measured:+7.0%}")
    print(f"max relative error {report['max_rel_error']:.0%}; parameters: "
          + ", ".join(f"{k} {v:.2f}" for k, v in parameters.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
