"""A real etcd server for tests and the harness: Debian's `etcd-server` (/usr/bin/etcd) on free
127.0.0.1 ports with a temporary data dir; it can be stopped and started again on the same data."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from local_ports import free_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def etcd_available() -> bool:
    return Path(ETCD).exists()


class EtcdServer:
    """``with EtcdServer(data_dir) as etcd: etcd.endpoint`` -> "127.0.0.1:PORT"."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self._proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> None:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self._proc = subprocess.Popen(
            [ETCD, "--name", "default", "--data-dir", str(self.data_dir), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"default={peer}"],
            stdout=open(self.data_dir.with_suffix(".log"), "a"), stderr=subprocess.STDOUT,  # noqa: SIM115
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._proc.returncode}; see {self.data_dir.with_suffix('.log')}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"etcd did not listen on {self.endpoint} within {timeout:.0f} s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=30)
        self._proc = None

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
