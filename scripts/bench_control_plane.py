"""The control plane at N nodes, emulated on one machine: N real rendezvous participants (torch's
DynamicRendezvousHandler, made as the agent makes it, with this project's prompt re-rendezvous and
membership watch, and no workers) against the c10d store or a real etcd.

    python scripts/bench_control_plane.py --nodes 8,32,128,256 --backend c10d,etcd3 --json out.json

Participants run as threads, ``--per-process`` of them in each worker process (a process per
participant would import torch N times), each with a backend and store client of its own. One more
process holds a single participant, the victim: after the first round formed and the steady state
was measured, it is SIGKILLed. That is a node's death as its peers see it: its heartbeats stop,
its connections are reset by the kernel, and nothing is said to anyone.

Per backend and N: ``form_s`` (from the start signal until every participant has joined the first
round; with ``--start-spread-s S`` the participants start evenly over S seconds, as a job's nodes
start over seconds, instead of all at once), ``detect_s`` (from the kill until the last survivor's membership watch reports the loss;
``detect_p50_s`` for the median), ``rerendezvous_s`` (from the kill until every survivor is in
the next round, with the N-1 survivors), ``ops_per_s`` and ``bytes_per_s`` in steady state (after
the first round, over ``--steady-s``): for etcd3, etcd's own counters from its /metrics endpoint
(gRPC messages received, bytes received from clients; ``sent_bytes_per_s`` beside it); for c10d,
whose TCPStore has no counters, every store call of the rendezvous backends counted in the
clients, and the bytes the store's server received as the kernel counts them (``ss``).
``changes_before_kill`` counts membership changes the watches reported while nothing had failed
(heartbeats that lapsed on a loaded machine). ``peak_rss_bytes`` is the largest sum of the participants' and benchmark's processes' resident
memory seen (the etcd server's beside it).

Backends: ``c10d``, ``etcd3`` (heartbeats as leased keys of their own, `heartbeats=keys`), and
``etcd3-blob`` (etcd3 with torch's layout: every heartbeat inside the shared state).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.etcd_server import EtcdServer  # noqa: E402
from harness.machine import describe  # noqa: E402

BACKENDS = ("c10d", "etcd3", "etcd3-blob")
RUN_ID = "bench"
HOST = "127.0.0.1"
MONITOR_INTERVAL_S = 0.1
"""How often each participant asks its membership watch, as the agent's monitor loop does."""


@dataclass(frozen=True)
class Settings:
    """One case's rendezvous settings; heartbeats as configs/local.yaml has them (1 s x 3)."""

    backend: str
    nodes: int
    endpoint: str
    keep_alive_interval_s: int = 1
    keep_alive_max_attempt: int = 3
    last_call_timeout_s: int = 30
    join_timeout_s: int = 600
    start_spread_s: float = 0.0
    """Participant i starts its first rendezvous spread x i / N seconds after the start signal."""

    @property
    def heartbeat_timeout_s(self) -> int:
        return self.keep_alive_interval_s * self.keep_alive_max_attempt


# --- participants (in the worker processes) -----------------------------------------------------


class CallCounter:
    """Counts calls across a process' threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0

    def add(self) -> None:
        with self._lock:
            self.calls += 1


class CountingStore:
    """A store client that counts the calls made through it (the c10d TCPStore has no counters)."""

    def __init__(self, store: Any, counter: CallCounter) -> None:
        self._store = store
        self._counter = counter

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if not callable(attribute):
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counter.add()
            return attribute(*args, **kwargs)

        return counted


def rendezvous_parameters(settings: Settings) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    conf: dict[str, Any] = {"join_timeout": settings.join_timeout_s, "last_call_timeout": settings.last_call_timeout_s,
                            "keep_alive_interval": settings.keep_alive_interval_s,
                            "keep_alive_max_attempt": settings.keep_alive_max_attempt}
    backend = "c10d"
    if settings.backend.startswith("etcd3"):
        backend = "etcd3"
        conf["heartbeats"] = "state" if settings.backend == "etcd3-blob" else "keys"
    else:
        conf["is_host"] = False
    # min_nodes N-1: the first round forms with all N (max_nodes), the one after the kill with the rest.
    return RendezvousParameters(backend=backend, endpoint=settings.endpoint, run_id=RUN_ID,
                                min_nodes=max(1, settings.nodes - 1), max_nodes=settings.nodes, local_addr=HOST, **conf)


def make_handler(settings: Settings, counter: CallCounter) -> Any:
    """A DynamicRendezvousHandler as the agent gets it from torch's registry; for c10d, made the way
    torch's c10d factory makes it, with its store client counted."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from agent.rendezvous import etcd3_backend

    params = rendezvous_parameters(settings)
    if params.backend == "etcd3":
        return etcd3_backend.create_etcd3_handler(params)
    host, port = settings.endpoint.rsplit(":", 1)
    client = TCPStore(host, int(port), is_master=False, timeout=_seconds(60))
    return create_handler(client, C10dRendezvousBackend(CountingStore(client, counter), RUN_ID), params)


class Participant:
    """One emulated node: its handler with the agent's prompt executor and membership watch."""

    def __init__(self, index: int, settings: Settings, counter: CallCounter, report: Callable[..., None]) -> None:
        from agent import torch_private
        from agent.membership import MembershipWatch
        from agent.recovery_agent import tcp_store_on
        from agent.rendezvous.prompt import PromptOpExecutor

        self.index = index
        self.handler = make_handler(settings, counter)
        keep_alive = float(settings.keep_alive_interval_s)
        # As RecoveryAgent.__init__ installs them.
        self.executor = PromptOpExecutor.install(self.handler, poll_interval=keep_alive / 10)
        self.watch = MembershipWatch(self.handler, ledger=self.executor.ledger, poll_interval=keep_alive / 4)
        torch_private.bind_shared_store(self.handler, tcp_store_on)
        self._report = report

    def rendezvous(self) -> Any:
        """The agent's rendezvous: watch paused, torch's next_rendezvous, rank 0 publishes the
        workers' master address, the watch starts the round."""
        from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

        self.watch.pause()
        info = self.handler.next_rendezvous()
        self.executor.rejoining = True
        if info.rank == 0:
            info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, info.bootstrap_store_info.master_addr)
            info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(info.bootstrap_store_info.master_port))
        self.watch.start_round()
        return info

    def run(self, go: threading.Event, delay_s: float) -> None:
        go.wait()
        time.sleep(delay_s)
        try:
            info = self.rendezvous()
            self._report("formed", self.index, time.time(), info.world_size)
            while True:
                change = self.watch.check(workers_healthy=True)
                if change is not None:
                    self._report("detected", self.index, time.time(), change.cause)
                    info = self.rendezvous()
                    self._report("reformed", self.index, time.time(), info.world_size)
                time.sleep(MONITOR_INTERVAL_S)
        except Exception as exc:  # reported to the benchmark, which records it for the case
            self._report("failed", self.index, time.time(), f"{type(exc).__name__}: {exc}")


def worker_main(settings: Settings, first: int, count: int, conn: Connection) -> None:
    """A worker process: ``count`` participants as threads; commands from the benchmark on ``conn``:
    "go" (start the first rendezvous), "count" (answer the store calls made so far), "stop"."""
    counter = CallCounter()
    lock = threading.Lock()

    def report(*message: Any) -> None:
        with lock:
            conn.send(message)

    participants = [Participant(first + i, settings, counter, report) for i in range(count)]
    go = threading.Event()
    for participant in participants:
        delay = settings.start_spread_s * participant.index / settings.nodes
        threading.Thread(target=participant.run, args=(go, delay), daemon=True).start()
    report("ready", first, time.time(), count)
    while True:
        command = conn.recv()
        if command == "go":
            go.set()
        elif command == "count":
            report("count", first, time.time(), counter.calls)
        else:
            os._exit(0)  # threads block in the backends; nothing to clean up in an emulated node


# --- the benchmark's side -----------------------------------------------------------------------


@dataclass
class Worker:
    process: Any
    conn: Connection
    first: int
    count: int


class Case:
    """One backend at one N: the control-plane server, the worker processes, the measurements."""

    def __init__(self, settings: Settings, per_process: int, server_pid: int | None, phase_timeout_s: float) -> None:
        self.settings = settings
        self.phase_timeout_s = phase_timeout_s
        self.server_pid = server_pid
        self.peak_rss = 0
        self.peak_server_rss = 0
        self.events: list[tuple[Any, ...]] = []
        context = multiprocessing.get_context("spawn")
        survivors = settings.nodes - 1
        sizes = [1] + _split(survivors, math.ceil(survivors / per_process))
        self.workers: list[Worker] = []
        first = 0
        for size in sizes:
            mine, theirs = context.Pipe()
            process = context.Process(target=worker_main, args=(settings, first, size, theirs), daemon=True)
            process.start()
            self.workers.append(Worker(process, mine, first, size))
            first += size
        self.victim = self.workers[0]

    def collect(self, done: Callable[[], bool], what: str) -> None:
        """Receive the workers' reports until ``done()``, sampling memory; raise after the phase timeout."""
        deadline = time.monotonic() + self.phase_timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {self.phase_timeout_s:.0f} s")
            live = [w.conn for w in self.workers if w.process.is_alive()]
            for conn in wait(live, timeout=0.5):
                try:
                    message = conn.recv()
                except EOFError:
                    continue
                if message[0] == "failed":
                    raise RuntimeError(f"participant {message[1]} failed: {message[3]}")
                self.events.append(message)
            self.sample_memory()

    def sample_memory(self) -> None:
        pids = [os.getpid()] + [w.process.pid for w in self.workers if w.process.is_alive()]
        self.peak_rss = max(self.peak_rss, sum(_rss(pid) for pid in pids))
        if self.server_pid is not None:
            self.peak_server_rss = max(self.peak_server_rss, _rss(self.server_pid))

    def seen(self, kind: str) -> list[tuple[Any, ...]]:
        return [e for e in self.events if e[0] == kind]

    def count_calls(self) -> int:
        before = len(self.seen("count"))
        survivors = [w for w in self.workers if w.process.is_alive()]
        for worker in survivors:
            worker.conn.send("count")
        self.collect(lambda: len(self.seen("count")) >= before + len(survivors), "store call counts")
        return sum(e[3] for e in self.seen("count")[before:])

    def stop(self) -> None:
        for worker in self.workers:
            if worker.process.is_alive():
                worker.conn.send("stop")
        for worker in self.workers:
            worker.process.join(timeout=10)
            if worker.process.is_alive():
                worker.process.kill()


def run_case(settings: Settings, *, per_process: int, steady_s: float, phase_timeout_s: float,
             server_pid: int | None, counters: Callable[[Case], dict[str, float]]) -> dict[str, Any]:
    """Form, measure the steady state, kill the victim, measure detection and the next round."""
    nodes = settings.nodes
    case = Case(settings, per_process, server_pid, phase_timeout_s)
    result: dict[str, Any] = {"participants_per_process": per_process, "processes": len(case.workers)}
    try:
        case.collect(lambda: sum(e[3] for e in case.seen("ready")) >= nodes, "participants ready")
        started = time.time()
        for worker in case.workers:
            worker.conn.send("go")
        case.collect(lambda: len(case.seen("formed")) >= nodes, "first round")
        formed = case.seen("formed")
        result["form_s"] = max(e[2] for e in formed) - started
        result["first_round_world_sizes"] = sorted({e[3] for e in formed})
        time.sleep(2.0)  # every watch has started its round and read once
        before, cpu_before, t0 = counters(case), _cpu_seconds(case), time.monotonic()
        while time.monotonic() - t0 < steady_s:
            time.sleep(0.5)
            case.sample_memory()
        after, cpu_after, t1 = counters(case), _cpu_seconds(case), time.monotonic()
        elapsed = t1 - t0
        for name in before:
            result[name] = (after[name] - before[name]) / elapsed
        result["cpu_cores_used_steady"] = (cpu_after - cpu_before) / elapsed
        killed = time.time()
        os.kill(case.victim.process.pid, signal.SIGKILL)

        def after_kill(kind: str) -> list[tuple[Any, ...]]:
            return [e for e in case.seen(kind) if e[2] >= killed]

        case.collect(lambda: len({e[1] for e in after_kill("reformed")}) >= nodes - 1, "re-rendezvous after the kill")
        detections = after_kill("detected")
        detected = [e[2] - killed for e in detections]
        reformed = after_kill("reformed")
        result.update(rerendezvous_s=max(e[2] for e in reformed) - killed,
                      causes=sorted({e[3] for e in detections}),
                      second_round_world_sizes=sorted({e[3] for e in reformed}),
                      changes_before_kill=len(case.seen("detected")) - len(detected))
        if not detected:  # every survivor was re-forming rounds already: the kill was not what they saw
            raise RuntimeError(f"no survivor's watch reported a change after the kill "
                               f"({result['changes_before_kill']} changes before it)")
        result.update(detect_s=max(detected), detect_p50_s=statistics.median(detected))
    except (TimeoutError, RuntimeError) as exc:
        result["error"] = str(exc)
    finally:
        result["peak_rss_bytes"] = case.peak_rss
        result["server_peak_rss_bytes"] = case.peak_server_rss
        case.stop()
    for name in ("form_s", "detect_s", "rerendezvous_s", "ops_per_s", "bytes_per_s"):
        result.setdefault(name, None)
    return result


# --- servers and their counters -----------------------------------------------------------------


@contextmanager
def c10d_server() -> Iterator[tuple[str, int, Callable[[Case], dict[str, float]]]]:
    """The embedded c10d store, hosted here as node 0's agent hosts it."""
    from agent.recovery_agent import tcp_store_on

    server = tcp_store_on(HOST)
    held = [server]  # the store serves while held; released (and its port closed) after the case

    def counters(case: Case) -> dict[str, float]:
        return {"ops_per_s": case.count_calls(), "bytes_per_s": _ss_bytes_received(held[0].port)}

    yield f"{HOST}:{server.port}", os.getpid(), counters
    del server
    held.clear()


@contextmanager
def etcd_server(work: Path) -> Iterator[tuple[str, int, Callable[[Case], dict[str, float]]]]:
    """A real etcd of its own for one case (a fresh data directory: counters from zero)."""
    data = work / f"etcd-{time.monotonic_ns()}"
    with EtcdServer(data) as etcd:
        assert etcd._proc is not None

        def counters(case: Case) -> dict[str, float]:
            metrics = etcd_metrics(etcd.endpoint)
            return {"ops_per_s": metrics["grpc_server_msg_received_total"],
                    "bytes_per_s": metrics["etcd_network_client_grpc_received_bytes_total"],
                    "sent_bytes_per_s": metrics["etcd_network_client_grpc_sent_bytes_total"],
                    "mvcc_puts_per_s": metrics["etcd_mvcc_put_total"],
                    "watch_events_per_s": metrics["etcd_debugging_mvcc_events_total"]}

        yield etcd.endpoint, etcd._proc.pid, counters
    shutil.rmtree(data, ignore_errors=True)


_METRIC = re.compile(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$")


def etcd_metrics(endpoint: str) -> dict[str, float]:
    """etcd's Prometheus counters, each summed over its labels."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match:
            totals[match[1]] = totals.get(match[1], 0.0) + float(match[3])
    return totals


def _ss_bytes_received(port: int) -> float:
    """Bytes the kernel received on the server's connections on ``port`` (ss's bytes_received)."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return float(sum(int(n) for n in re.findall(r"bytes_received:(\d+)", out)))


def _rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def _cpu_seconds(case: Case) -> float:
    pids = [os.getpid()] + [w.process.pid for w in case.workers if w.process.is_alive()]
    if case.server_pid is not None and case.server_pid != os.getpid():
        pids.append(case.server_pid)
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def _split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal positive sizes."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)] if parts else []


def _seconds(s: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="8,32,128,256", help="comma-separated participant counts")
    parser.add_argument("--backend", default="c10d,etcd3", help=f"comma-separated, of {', '.join(BACKENDS)}")
    parser.add_argument("--per-process", type=int, default=32, help="participants per worker process")
    parser.add_argument("--steady-s", type=float, default=10.0, help="how long the steady state is measured")
    parser.add_argument("--phase-timeout-s", type=float, default=180.0,
                        help="a phase (forming, re-rendezvous) not done by then is recorded as an error")
    parser.add_argument("--start-spread-s", type=float, default=0.0,
                        help="start the participants evenly over this long, as a job's nodes start over seconds "
                             "(0: all at once)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    backends = [b.strip() for b in args.backend.split(",")]
    for backend in backends:
        if backend not in BACKENDS:
            parser.error(f"--backend {backend}: not one of {', '.join(BACKENDS)}")
    if any(n < 2 for n in sizes):
        parser.error("--nodes: every count must be at least 2 (one participant is killed)")
    report: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "machine_before": describe(), "steady_s": args.steady_s, "results": {}}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="bench-control-plane-") as work:
        for backend in backends:
            for nodes in sizes:
                server = c10d_server() if backend == "c10d" else etcd_server(Path(work))
                with server as (endpoint, server_pid, counters):
                    settings = Settings(backend=backend, nodes=nodes, endpoint=endpoint,
                                        start_spread_s=args.start_spread_s)
                    result = run_case(settings, per_process=args.per_process, steady_s=args.steady_s,
                                      phase_timeout_s=args.phase_timeout_s, server_pid=server_pid, counters=counters)
                result["settings"] = asdict(settings)
                report["results"].setdefault(backend, {})[str(nodes)] = result
                print(_row(backend, nodes, result), flush=True)
                save()  # after every case: a run cut short keeps what it measured
    report["machine_after"] = describe()
    save()


def _row(backend: str, nodes: int, r: dict[str, Any]) -> str:
    def f(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    return (f"{backend:>10} N={nodes:<4} form {f(r['form_s'], '6.2f')} s  detect {f(r['detect_s'], '5.2f')} s  "
            f"rerendezvous {f(r['rerendezvous_s'], '6.2f')} s  ops {f(r['ops_per_s'], '8.0f')}/s  "
            f"bytes {f(r['bytes_per_s'], '10.0f')}/s  rss {r['peak_rss_bytes'] / 2**30:.2f} GiB"
            + (f"  ERROR {r['error']}" if "error" in r else ""))


if __name__ == "__main__":
    main()
