"""Checks scripts/simulate_scale.py's model against this machine, both sides measured in one run:
the parameters the model is given (storage read speeds from the raw-read column of a restore
benchmark run now; one reader stream, read beside each of that run's cold torch.loads from the
same file; torchsnapshot's speed relative to the raw read, on a state a quarter the size; filling
new memory (alone, and by as many processes at once as a recovery's workers) and writing over
touched memory; workers forked from a warm process with their process-group init and model
build; a killed agent seen from its liveness connection; the rendezvous settings of the harness)
and the figures it predicts (that same restore run's torchrevive, torchsnapshot and torch.load
columns; a kill and a freeze in a local cluster run now).

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

from harness.scale_model import Assumptions, torchrevive

REPO = Path(__file__).resolve().parents[1]

WARM_WORKER = textwrap.dedent("""
    # As the example's workers start when they resume: forked warm, a gloo group, the model built
    # without initializers and wrapped in DDP without a broadcast (the restore sets the values).
    import os, sys, time
    forked = time.time()
    import torch, torch.distributed as dist
    from examples.mlp import build_model
    rank, world, port, width = map(int, sys.argv[1:5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    grouped = time.time()
    torch.nn.parallel.DistributedDataParallel(build_model(width, torch.device("cpu"), initialize=False), init_sync=False)
    print(forked, grouped, time.time(), flush=True)
    os._exit(0)
""")
FIRST_TOUCH = textwrap.dedent("""
    import sys, time
    import torch
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    torch.empty(int(sys.argv[1]), dtype=torch.uint8).fill_(1)
    print(time.perf_counter() - start, flush=True)
""")
LIVENESS_PEER = textwrap.dedent("""
    import sys, time
    from torch.distributed import TCPStore
    from agent.liveness import PeerLiveness
    store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
    PeerLiveness("127.0.0.1", on_dead=lambda node, at: None).start_round(store, "peer", ["peer", "watcher"])
    print("ready", flush=True)
    time.sleep(600)
""")


def overwrite_gbps(size: int = 1 << 30, repeats: int = 3) -> float:
    """Writing over memory already touched (median of ``repeats``): what a warm restore pays to
    land each byte it copies from the page cache in tensors that exist, beside the raw read's
    copy into a buffer that stays in the CPU's cache."""
    import torch

    buffer = torch.empty(size, dtype=torch.uint8)
    buffer.fill_(0)
    rates = []
    for value in range(1, repeats + 1):
        start = time.perf_counter()
        buffer.fill_(value)
        rates.append(size / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def first_touch_gbps(size: int = 1 << 30, processes: int = 1) -> float:
    """Filling freshly allocated memory (page faults included), per process, with ``processes``
    doing it at once: what materializing a loaded checkpoint in new tensors costs, beside copying
    into existing ones (as the workers of a recovery do, each into the model it just built)."""
    fillers = [subprocess.Popen([sys.executable, "-c", FIRST_TOUCH, str(size)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    if not all(f.stdout is not None and f.stdout.readline().strip() == "ready" for f in fillers):
        raise RuntimeError("a memory-filling process failed to start")
    for filler in fillers:  # every filler starts at once
        assert filler.stdin is not None
        filler.stdin.write("go\n")
        filler.stdin.flush()
    slowest = max(float(f.communicate()[0]) for f in fillers)
    return size / slowest / 1e9


def warm_worker_start(workers: int, width: int) -> dict[str, float]:
    """Fork ``workers`` workers at once from a warm process as the agent does (it has imported
    torch, torchrevive's worker API and the harness's preload), each joining a gloo group and
    building the example model under DDP: the fork, the group's init and the build, each until the
    last worker is through it."""
    from agent.warm_workers import WarmProcess, become_subreaper
    from harness.nodes import job_env
    from harness.ports import free_port

    become_subreaper()
    port, env = free_port(), job_env()
    warm = WarmProcess(["torch._dynamo"], env)
    with tempfile.TemporaryDirectory() as work:
        script = Path(work) / "warm_worker.py"
        script.write_text(WARM_WORKER)
        if warm.wait_ready():
            raise RuntimeError(f"the warm process is unusable: {warm.problem}")
        outs = [open(Path(work) / f"out{rank}", "w+") for rank in range(workers)]  # noqa: SIM115
        start = time.time()
        procs = [warm.fork([sys.executable, "-u", str(script), str(rank), str(workers), str(port), str(width)], env,
                           [0, out.fileno(), 2]) for rank, out in enumerate(outs)]
        if not all(proc.wait(300) == 0 for proc in procs):
            raise RuntimeError("a calibration worker failed")
        times = [[float(t) for t in (Path(work) / f"out{rank}").read_text().split()] for rank in range(workers)]
        for out in outs:
            out.close()
    warm.close()
    forked, grouped, built = (max(column) for column in zip(*times))
    return {"warm_fork_s": forked - start, "process_group_init_s": grouped - forked, "model_build_s": built - grouped}


def liveness_detect_s(monitor_interval: float, repeats: int = 3) -> float:
    """A peer agent's process killed: until this agent's liveness connection to it says so, plus
    half the monitor interval the agent acts on it in (median of ``repeats``)."""
    import queue
    import signal

    from torch.distributed import TCPStore

    from agent.liveness import ADDRESS_KEY, PeerLiveness

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    latencies = []
    for attempt in range(repeats):
        deaths: queue.Queue = queue.Queue()
        peer = subprocess.Popen([sys.executable, "-c", LIVENESS_PEER, str(store.port)], cwd=REPO, env=_job_env(),
                                stdout=subprocess.PIPE, text=True)
        if peer.stdout is None or peer.stdout.readline().strip() != "ready":
            raise RuntimeError("the liveness peer failed to start")
        watcher = PeerLiveness("127.0.0.1", on_dead=lambda node, at: deaths.put(time.time()))
        watcher.start_round(store, "watcher", ["peer", "watcher"])
        time.sleep(1.0)  # connected
        killed = time.time()
        peer.send_signal(signal.SIGKILL)
        latencies.append(deaths.get(timeout=30) - killed)
        peer.wait()
        watcher.close()
        for node in ("peer", "watcher"):  # the next pair publishes its own addresses
            store.delete_key(ADDRESS_KEY.format(node=node))
    return statistics.median(latencies) + monitor_interval / 2


def restore_run(size_gb: float, repeats: int, methods: str = "torchrevive,torchsnapshot,torch_load,raw_read") -> dict:
    """scripts/bench_restore.py now, for ``methods`` (by default the ones the rows compare, and
    the raw read)."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "restore.json"
        subprocess.run([sys.executable, str(REPO / "scripts" / "bench_restore.py"), "--size-gb", str(size_gb),
                        "--repeats", str(repeats), "--methods", methods, "--json", str(out)],
                       check=True, cwd=REPO, env=_job_env())
        return json.loads(out.read_text())


def parallel_efficiency(size_gb: float, repeats: int) -> float:
    """torchsnapshot's cold restore speed as a fraction of the raw read's, measured on a smaller
    state (the model's ``parallel_efficiency``, which it scales to the large one)."""
    results = restore_run(size_gb, repeats, methods="torchsnapshot,raw_read")["results"]
    return results["torchsnapshot"]["cold_gbps"] / results["raw_read"]["cold_gbps"]


def cluster_run(nodes: int, state_mb: float) -> dict:
    """scripts/local_cluster.py now: a kill, then a freeze, in one job of ``nodes`` nodes x 1."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "cluster.json"
        subprocess.run([sys.executable, str(REPO / "scripts" / "local_cluster.py"), "--nodes", str(nodes),
                        "--scenario", "kill,freeze", "--state-mb", str(state_mb), "--json", str(out)],
                       check=True, cwd=REPO, env=_job_env())
        return json.loads(out.read_text())


def _job_env() -> dict[str, str]:
    from harness.nodes import job_env

    return job_env()


def restore_rows(bench: dict, first_touch: float, overwrite: float, efficiency: float) -> list[tuple[str, float, float]]:
    """torchrevive reads at the raw read's speed (warm, each byte also lands in existing tensors);
    torchsnapshot at ``efficiency`` of it; torch.load reads one stream (measured beside it on the
    same file), into new tensors, that load_state_dict copies into the state."""
    results, size = bench["results"], bench["size_bytes"]
    raw_cold, raw_warm = results["raw_read"]["cold_gbps"], results["raw_read"]["warm_gbps"]
    stream_s = results["torch_load"]["stream_cold_s"]
    gb = size / 1e9
    return [
        (f"restore {gb:.1f} GB, torchrevive, cold", size / (raw_cold * 1e9), results["torchrevive"]["cold_s"]),
        (f"restore {gb:.1f} GB, torchrevive, warm", size / (raw_warm * 1e9) + size / (overwrite * 1e9),
         results["torchrevive"]["warm_s"]),
        (f"restore {gb:.1f} GB, torchsnapshot, cold", size / (raw_cold * efficiency * 1e9),
         results["torchsnapshot"]["cold_s"]),
        (f"restore {gb:.1f} GB, classic torch.load, cold", stream_s + size / (first_touch * 1e9)
         + size / (raw_warm * 1e9), results["torch_load"]["cold_s"]),
    ]


def recovery_rows(cluster: dict, bench: dict, start: dict[str, float], detect_s: float,
                  fresh_touch_gbps: float) -> list[tuple[str, float, float]]:
    """The harness's job is DDP (every rank restores the whole state, `restore.replicated: all`)
    from the page cache (its snapshot was just written) into a model built uninitialized: each
    byte is copied from the cache into a page touched for the first time."""
    raw = bench["results"]["raw_read"]
    copy_gbps = 1 / (1 / raw["warm_gbps"] + 1 / fresh_touch_gbps)
    rows = []
    for run, failure in zip(cluster["runs"], ("kill", "hang")):
        nodes, nproc = run["world_size_before"] // cluster["nproc_per_node"], cluster["nproc_per_node"]
        local = replace(Assumptions(), gpus=nodes * nproc, gpus_per_node=nproc, size_bytes=cluster["state_bytes"],
                        replicated_fraction=1.0, stripe_replicated=False,
                        storage_aggregate_gbps=raw["cold_gbps"], client_gbps=raw["cold_gbps"],
                        memory_gbps=copy_gbps, page_cache_warm=1.0, rendezvous_s=0.5, failure=failure,
                        keep_alive_s=1.0, keep_alive_attempts=3, first_step_s=0.0, liveness_detect_s=detect_s, **start)
        predicted = sum(torchrevive(local).values())
        measured = run["recovery_s"] - run["phases"]["first_step"]
        scenario = "kill" if failure == "kill" else "freeze"
        rows.append((f"recovery after a {scenario}, {nodes} nodes x {nproc}, {cluster['state_bytes'] / 1e6:.0f} MB",
                     predicted, measured))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0, help="the restore benchmark's state")
    parser.add_argument("--repeats", type=int, default=3, help="the restore benchmark's repeats")
    parser.add_argument("--nodes", type=int, default=4, help="the local cluster's nodes (one rank each)")
    parser.add_argument("--state-mb", type=float, default=512, help="the local cluster's training state")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from harness.workloads import width_for

    first_touch, overwrite = first_touch_gbps(), overwrite_gbps()
    efficiency = parallel_efficiency(args.size_gb / 4, args.repeats)
    bench = restore_run(args.size_gb, args.repeats)
    cluster = cluster_run(args.nodes, args.state_mb)
    # The survivors of the kill start their workers: as many as the cluster has after it.
    start = warm_worker_start(args.nodes - 1, width_for(args.state_mb))
    fresh_touch = first_touch_gbps(cluster["state_bytes"], processes=args.nodes - 1)  # the survivors' workers at once
    detect = liveness_detect_s(monitor_interval=0.1)  # the harness's job.monitor_interval
    raw = bench["results"]["raw_read"]
    parameters = {"raw_read_cold_gbps": raw["cold_gbps"], "raw_read_warm_gbps": raw["warm_gbps"],
                  "stream_read_gbps": bench["size_bytes"] / bench["results"]["torch_load"]["stream_cold_s"] / 1e9,
                  "first_touch_gbps": first_touch, "overwrite_gbps": overwrite,
                  "parallel_efficiency": efficiency,
                  "first_touch_concurrent_gbps": fresh_touch, "liveness_detect_s": detect, **start}
    rows = restore_rows(bench, first_touch, overwrite, efficiency) + recovery_rows(cluster, bench, start, detect, fresh_touch)
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
