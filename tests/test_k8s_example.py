"""The Kubernetes example (configs/k8s/pytorchjob.yaml, with the Secrets
configs/k8s/make-etcd-secrets.sh makes) validates: every document against the published schema of
its kind (Kubernetes' own, and the Kubeflow training operator's PyTorchJob CRD, vendored in
tests/data/k8s_schemas), strictly, so a misspelt field fails; the 3-member etcd cluster and the
job's endpoints agree; the worker pod runs as the image's user with a memory-backed /dev/shm; the
job config loads through our own loader, and the container's command line parses through
`torchrevive run`'s parser with the PET_* variables the operator injects.

And it stays hardened: etcd speaks only TLS to clients and peers and asks both for certificates;
the agents log in with a certificate and a password from Secrets; no listener binds every
interface (metrics and health on the pod's IP); the event log is on each pod's own volume; the
NetworkPolicies admit only the job's pods (and monitoring, to metrics and health). The last test
runs it: the StatefulSet's etcd command lines form a real 3-member cluster on this machine with the
script's certificates, the auth Job's script turns on authentication, and an agent with the job's
config joins a rendezvous, while plaintext, a missing client certificate, a wrong password and keys
outside the job's prefix are refused."""

from __future__ import annotations

import base64
import copy
import os
import re
import shlex
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from conftest import REPO, free_port
from dockerfile import numeric_uid, parse_dockerfile
from harness.etcd_server import OPENSSL, etcd_available
from k8s_local_pod import POD_IP, container_env, expand, local_paths, map_addresses, mount_volumes
from k8s_network_policies import Pod, admits, isolated
from k8s_schemas import manifest_errors, pod_template_errors, strict_structural_schema
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from agent.config import load_config, parse_endpoints, rdzv_conf_for_torch, validate
from agent.rendezvous.etcd3_backend import DEFAULT_PREFIX, Etcd3Lease, Etcd3Store, create_etcd3_handler, options_from
from agent.rendezvous.etcd3_client import Etcd3Connection, import_etcd3
from launcher.torchrun_flags import RunRequest, parse_run_args

MANIFEST = REPO / "configs" / "k8s" / "pytorchjob.yaml"
MAKE_SECRETS = REPO / "configs" / "k8s" / "make-etcd-secrets.sh"
NAMESPACE = "training"


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def document(kind: str, name: str | None = None) -> dict[str, Any]:
    """The manifest's one document of ``kind`` (named ``name`` where the kind has several)."""
    (found,) = [d for d in documents() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return found


def worker_pod() -> dict[str, Any]:
    return document("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def pytorch_container() -> dict[str, Any]:
    return next(c for c in worker_pod()["containers"] if c["name"] == "pytorch")


def etcd_pod() -> dict[str, Any]:
    return document("StatefulSet")["spec"]["template"]["spec"]


def etcd_flags() -> dict[str, str]:
    (container,) = etcd_pod()["containers"]
    assert container["command"][0] == "etcd"
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["command"][1:])


def auth_job_pod() -> dict[str, Any]:
    return document("Job", "torchrevive-etcd-auth")["spec"]["template"]["spec"]


def mounted_volume(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """(the volume a path of the container lies on, the path inside that volume)."""
    mounts = sorted(container["volumeMounts"], key=lambda m: len(m["mountPath"]), reverse=True)
    mount = next(m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return volume, path[len(mount["mountPath"]):].strip("/")


def secret_key(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of a file a container reads from a Secret volume."""
    volume, inside = mounted_volume(pod, container, path)
    assert "secret" in volume, f"{path} is not on a Secret volume: {volume}"
    items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])} or None
    return volume["secret"]["secretName"], items[inside] if items else inside


def resolved_job(job_yaml: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[RunRequest, list[str]]:
    """The worker container's command line as `torchrevive run` resolves it on a pod whose IP is
    POD_IP, with what the operator injects (flags on the command line win), and the argv."""
    container = pytorch_container()
    env = container_env(container, {"status.podIP": POD_IP})
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "job-config")
    argv = [str(job_yaml) if a == f"{mount}/job.yaml" else expand(a, env) for a in container["command"][2:]]
    spec = document("PyTorchJob")["spec"]
    policy = spec["elasticPolicy"]
    for name, value in {"PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
                        "PET_NPROC_PER_NODE": spec["nprocPerNode"], "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
                        "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "torchrevive-example-worker-0:23456"}.items():
        monkeypatch.setenv(name, value)
    return parse_run_args(argv), argv


@pytest.fixture
def job_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(document("ConfigMap", "torchrevive-job")["data"]["job.yaml"])
    return path


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The Secrets make-etcd-secrets.sh writes, by name (127.0.0.1 added to the members'
    certificate, as for a port-forward, so that they serve on this machine)."""
    directory = tmp_path_factory.mktemp("secrets") / "etcd"
    subprocess.run(["bash", str(MAKE_SECRETS), str(directory), NAMESPACE], check=True, capture_output=True,
                   env={**os.environ, "EXTRA_SANS": f"IP:{POD_IP}"})
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all((directory / "secrets.yaml").read_text())}


@pytest.mark.parametrize("kind, name", [(d["kind"], d["metadata"]["name"]) for d in documents()])
def test_each_document_is_valid_against_its_published_schema(kind, name):
    assert manifest_errors(document(kind, name)) == []


def edit(kind: str, path: str, value: Any = None, rename: str | None = None, name: str | None = None) -> dict[str, Any]:
    """A copy of the manifest's `kind` document with the field at dotted `path` set to `value`,
    or renamed to `rename`."""
    doc = copy.deepcopy(document(kind, name))
    *parents, key = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = doc
    for part in parents:
        node = node[part]
    if rename is not None:
        node[rename] = node.pop(key)
    else:
        node[key] = value
    return doc


@pytest.mark.parametrize("doc, expected", [
    (edit("StatefulSet", "spec.replicas", rename="replica"),
     "StatefulSet torchrevive-etcd.spec: Additional properties are not allowed ('replica' was unexpected)"),
    (edit("StatefulSet", "spec.replicas", "three"),
     "StatefulSet torchrevive-etcd.spec.replicas: 'three' is not of type"),
    (edit("Service", "spec.ports.0.port", "2379"), "Service torchrevive-etcd.spec.ports.0.port: '2379' is not of type"),
    (edit("PersistentVolumeClaim", "spec.accessModes", rename="accessMode"), "('accessMode' was unexpected)"),
    (edit("ConfigMap", "metadata.name", rename="nmae", name="torchrevive-job"),
     "ConfigMap ?.metadata: Additional properties are not allowed"),
    (edit("PyTorchJob", "spec.pytorchReplicaSpecs.Worker.replicas", rename="replica"),
     "PyTorchJob torchrevive-example.spec.pytorchReplicaSpecs.Worker: Additional properties are not allowed "
     "('replica' was unexpected) (kubeflow.org_pytorchjobs.yaml)"),
    (edit("PyTorchJob", "spec.elasticPolicy.minReplicas", "2"),
     "PyTorchJob torchrevive-example.spec.elasticPolicy.minReplicas: '2' is not of type 'integer'"),
    (edit("PyTorchJob", "spec.elasticPolicy.nProcsPerNode", 8), "('nProcsPerNode' was unexpected)"),
    (edit("PyTorchJob", "spec.pytorchReplicaSpecs.Worker.template.spec.volumes.5.emptyDir.medium", rename="meduim"),
     "('meduim' was unexpected) (podtemplatespec-v1.json)"),
    (edit("PyTorchJob", "metadata.labl", {}), "('labl' was unexpected) (ObjectMeta in _definitions.json)"),
    (edit("NetworkPolicy", "spec.ingress.0.from.0.podSelector", rename="podSelecter", name="torchrevive-etcd"),
     "NetworkPolicy torchrevive-etcd.spec.ingress.0.from.0: Additional properties are not allowed ('podSelecter'"),
    (edit("NetworkPolicy", "spec.ingress.1.ports.0.port", [9400], name="torchrevive-example"),
     "NetworkPolicy torchrevive-example.spec.ingress.1.ports.0.port: [9400] is not valid under any of the given "
     "schemas"),
    (edit("Job", "spec.template.spec.volumes.1.secret.secretname", "x"),
     "('secretname' was unexpected) (job-batch-v1.json)"),
])
def test_a_misspelt_field_or_a_wrong_type_is_rejected_with_its_path(doc, expected):
    errors = manifest_errors(doc)
    assert any(expected in e for e in errors), errors


def test_pod_templates_are_checked_by_kubernetes_schema_where_the_crd_keeps_unknown_fields():
    lenient_crd = {"type": "object", "properties": {"template": {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"spec": {"type": "object"}}}}}
    strict = strict_structural_schema(lenient_crd)
    assert strict["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]["template"]  # the CRD alone would let a typo through
    template = copy.deepcopy(document("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
    assert pod_template_errors(template) == []
    template["spec"]["containers"][0]["volumeMount"] = template["spec"]["containers"][0].pop("volumeMounts")
    assert pod_template_errors(template) == [
        "template.spec.containers.0: Additional properties are not allowed ('volumeMount' was unexpected) "
        "(podtemplatespec-v1.json)"]


def test_an_unknown_kind_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"apiVersion 'policy/v1' kind 'PodDisruptionBudget'"):
        manifest_errors({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "x"}})


def secret_files_read() -> set[tuple[str, str]]:
    """(Secret, key) of every file a container of the example reads from a Secret: the paths in
    etcd's flags, the auth Job's variables and the job config's rendezvous options."""
    (etcd,) = etcd_pod()["containers"]
    (job,) = auth_job_pod()["containers"]
    conf = yaml.safe_load(document("ConfigMap", "torchrevive-job")["data"]["job.yaml"])["rendezvous"]["conf"]
    reads = [(etcd_pod(), etcd, path) for path in etcd_flags().values()]
    reads += [(auth_job_pod(), job, variable["value"]) for variable in job["env"]]
    reads += [(worker_pod(), pytorch_container(), path) for path in conf.values()]
    return {secret_key(pod, container, path) for pod, container, path in reads
            if isinstance(path, str) and path.startswith("/etc/etcd/")}


def test_the_secrets_script_makes_every_secret_and_key_the_pods_read(secrets):
    for secret in secrets.values():
        assert manifest_errors(secret) == []
    read = secret_files_read()
    assert len(read) == 8  # the members' and the agents' certificate, key and CA; two passwords
    mounted = {v["secret"]["secretName"] for pod in (worker_pod(), etcd_pod(), auth_job_pod())
               for v in pod["volumes"] if "secret" in v}
    assert {name for name, _ in read} == mounted == secrets.keys()
    missing = [(name, key) for name, key in read if key not in secrets[name]["data"]]
    assert not missing, missing


def certificate_subject(pem: bytes) -> str:
    return subprocess.run([OPENSSL, "x509", "-noout", "-subject", "-nameopt", "RFC2253"], input=pem,
                          capture_output=True, check=True).stdout.decode().strip()


def test_the_certificates_let_only_the_members_be_peers_and_grant_no_etcd_user(secrets):
    server, client = secrets["torchrevive-etcd-server-tls"]["data"], secrets["torchrevive-etcd-client-tls"]["data"]
    peer_cn = etcd_flags()["peer-cert-allowed-cn"]
    assert certificate_subject(base64.b64decode(server["tls.crt"])) == f"subject=CN={peer_cn}"
    # With --client-cert-auth etcd takes a certificate's CN as a user name: the agents' must name none.
    users = {"root", next(v["value"] for v in auth_job_pod()["containers"][0]["env"] if v["name"] == "ETCD_USER")}
    agent_cn = certificate_subject(base64.b64decode(client["tls.crt"])).removeprefix("subject=CN=")
    assert agent_cn not in users | {peer_cn}


def test_etcd_runs_three_members_that_know_each_other_by_stable_names():
    etcd, service = document("StatefulSet"), document("Service")
    assert etcd["spec"]["replicas"] == 3
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert etcd["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    names = [f"{etcd['metadata']['name']}-{i}" for i in range(etcd["spec"]["replicas"])]
    (container,) = etcd_pod()["containers"]
    flags = etcd_flags()
    assert flags["initial-cluster"].split(",") == [f"{n}=https://{n}.{service['metadata']['name']}:{ports['peer']}"
                                                   for n in names]
    assert flags["name"] == "$(POD_NAME)" and {"name": "POD_NAME", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.name"}}} in container["env"]
    assert flags["initial-advertise-peer-urls"] == f"https://$(POD_NAME).{service['metadata']['name']}:{ports['peer']}"
    (data,) = etcd["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert flags["data-dir"].startswith(mounts[data["metadata"]["name"]] + "/")


def test_etcd_speaks_only_tls_and_asks_clients_and_peers_for_certificates():
    flags = etcd_flags()
    for url_flag in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls", "initial-advertise-peer-urls"):
        assert all(url.startswith("https://") for url in flags[url_flag].split(",")), url_flag
    assert "http://" not in " ".join(etcd_pod()["containers"][0]["command"])
    assert flags["client-cert-auth"] == flags["peer-client-cert-auth"] == "true"
    assert flags["peer-cert-allowed-cn"]
    files = {"cert-file": "tls.crt", "key-file": "tls.key", "trusted-ca-file": "ca.crt",
             "peer-cert-file": "tls.crt", "peer-key-file": "tls.key", "peer-trusted-ca-file": "ca.crt"}
    for flag, key in files.items():
        assert secret_key(etcd_pod(), etcd_pod()["containers"][0], flags[flag]) == ("torchrevive-etcd-server-tls", key)


def etcd_client_endpoints() -> list[tuple[str, int]]:
    etcd, service = document("StatefulSet"), document("Service")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "client")
    return [(f"{etcd['metadata']['name']}-{i}.{service['metadata']['name']}", port)
            for i in range(etcd["spec"]["replicas"])]


def test_the_agents_log_in_to_etcd_with_a_client_certificate_and_a_password_file(job_yaml, monkeypatch):
    request, _ = resolved_job(job_yaml, monkeypatch)
    conf, pod, container = request.config.rendezvous.conf, worker_pod(), pytorch_container()
    assert {"ca_cert", "ssl_cert", "ssl_cert_key", "user", "password_file"} <= conf.keys()
    assert "password" not in conf  # in a file from a Secret, never in the config or on the command line
    assert secret_key(pod, container, conf["ca_cert"]) == ("torchrevive-etcd-client-tls", "ca.crt")
    assert secret_key(pod, container, conf["ssl_cert"]) == ("torchrevive-etcd-client-tls", "tls.crt")
    assert secret_key(pod, container, conf["ssl_cert_key"]) == ("torchrevive-etcd-client-tls", "tls.key")
    assert secret_key(pod, container, conf["password_file"]) == ("torchrevive-etcd-auth", "password")
    job_env = {v["name"]: v.get("value") for v in auth_job_pod()["containers"][0]["env"]}
    assert conf["user"] == job_env["ETCD_USER"]  # the user the auth Job creates
    assert f"{conf.get('key_prefix', DEFAULT_PREFIX).rstrip('/')}/".startswith(job_env["ETCD_KEY_PREFIX"])
    # The auth Job alone reads root's password.
    assert secret_key(auth_job_pod(), auth_job_pod()["containers"][0], job_env["ETCD_ROOT_PASSWORD_FILE"]) == (
        "torchrevive-etcd-auth", "root-password")
    auth_volumes = [v["secret"] for v in pod["volumes"]
                    if v.get("secret", {}).get("secretName") == "torchrevive-etcd-auth"]
    assert [[item["key"] for item in v.get("items", [])] for v in auth_volumes] == [["password"]]


def test_no_listener_binds_every_interface_and_metrics_and_health_use_the_pod_ip(job_yaml, monkeypatch):
    text = MANIFEST.read_text()
    assert "0.0.0.0" not in text and "[::]" not in text
    request, _ = resolved_job(job_yaml, monkeypatch)
    container = pytorch_container()
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert pod_ip in container["env"]
    assert request.config.observability.metrics_addr == POD_IP  # metrics and the health check
    assert request.config.launch.local_addr == POD_IP  # stores, liveness, memory data plane
    health_port = int(next(v["value"] for v in container["env"] if v["name"] == "TORCHELASTIC_HEALTH_CHECK_PORT"))
    declared = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert declared == {"metrics": request.config.observability.metrics_port, "health": health_port}
    assert etcd_flags()["listen-client-urls"] == "https://$(POD_IP):2379"
    assert etcd_flags()["listen-peer-urls"] == "https://$(POD_IP):2380"
    assert pod_ip in etcd_pod()["containers"][0]["env"]


def test_the_event_log_is_on_each_pods_own_volume(job_yaml, monkeypatch):
    request, _ = resolved_job(job_yaml, monkeypatch)
    volume, _ = mounted_volume(worker_pod(), pytorch_container(), request.config.observability.event_log)
    assert "emptyDir" in volume and "persistentVolumeClaim" not in volume
    assert not request.config.observability.event_log.startswith(request.config.checkpoint.dir)


def example_pod(kind: str) -> Pod:
    """A pod of the example ("job", "etcd", "auth") or another one (OTHER_PODS)."""
    if kind in OTHER_PODS:
        return OTHER_PODS[kind]
    templates = {"job": document("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"],
                 "etcd": document("StatefulSet")["spec"]["template"],
                 "auth": document("Job", "torchrevive-etcd-auth")["spec"]["template"]}
    return Pod(templates[kind]["metadata"]["labels"])


OTHER_PODS = {
    "monitoring": Pod({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring"),
    "neighbour": Pod({"app": "web"}),  # another pod in the job's namespace
    "stranger": Pod({"app": "torchrevive-example"}, namespace="other"),  # the job's label, elsewhere
}


@pytest.mark.parametrize("source, target, port, admitted", [
    ("job", "etcd", 2379, True), ("auth", "etcd", 2379, True), ("etcd", "etcd", 2380, True),
    ("job", "etcd", 2380, False), ("auth", "etcd", 2380, False), ("neighbour", "etcd", 2379, False),
    ("monitoring", "etcd", 2379, False), ("stranger", "etcd", 2379, False),
    # the stores, liveness, memory data plane and process groups: free ports, each round
    ("job", "job", 29500, True), ("job", "job", 45123, True), ("job", "job", 9400, True),
    ("monitoring", "job", 9400, True), ("monitoring", "job", 9401, True), ("monitoring", "job", 45123, False),
    ("neighbour", "job", 9400, False), ("neighbour", "job", 45123, False), ("stranger", "job", 45123, False),
    ("etcd", "job", 45123, False), ("auth", "job", 45123, False),
    ("job", "auth", 8080, False), ("neighbour", "auth", 8080, False),
])
def test_network_policies_admit_only_the_jobs_pods_and_monitoring(source, target, port, admitted):
    policies = [d for d in documents() if d["kind"] == "NetworkPolicy"]
    assert admits(policies, example_pod(source), example_pod(target), port) is admitted


def test_every_pod_of_the_example_is_isolated_by_a_network_policy():
    policies = [d for d in documents() if d["kind"] == "NetworkPolicy"]
    for kind in ("job", "etcd", "auth"):
        assert isolated(policies, example_pod(kind)), kind
    # a pod no policy selects accepts everything: the check above is what makes the rest mean something
    neighbour = example_pod("neighbour")
    assert not isolated(policies, neighbour) and admits(policies, neighbour, neighbour, 1)
    (deny,) = [p for p in policies if not p["spec"].get("ingress")]
    assert deny["spec"]["policyTypes"] == ["Ingress"]
    assert all(deny["spec"]["podSelector"]["matchLabels"].items() <= example_pod(k).labels.items()
               for k in ("job", "etcd", "auth"))


def test_the_worker_pod_runs_as_the_images_user_with_a_memory_backed_dev_shm():
    pod = worker_pod()
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] == context["fsGroup"] == numeric_uid(parse_dockerfile(REPO / "Dockerfile")[-1])
    container = pytorch_container()
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    (shm,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm]["emptyDir"]["medium"] == "Memory"
    assert re.fullmatch(r"\d+Gi", volumes[shm]["emptyDir"]["sizeLimit"])
    for spec in (pod, etcd_pod(), auth_job_pod()):  # none of them talks to the Kubernetes API
        assert spec["automountServiceAccountToken"] is False


def test_the_pytorchjob_is_an_elastic_job_the_operator_accepts():
    job = document("PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    assert 1 <= policy["minReplicas"] <= policy["maxReplicas"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    assert worker["restartPolicy"] in {"OnFailure", "Never", "Always", "ExitCode"}
    container = pytorch_container()
    assert container["command"][:2] == ["torchrevive", "run"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in worker_pod()["volumes"]}
    assert set(mounts) == set(volumes)
    claim = document("PersistentVolumeClaim")["metadata"]["name"]
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == claim
    assert volumes["job-config"]["configMap"]["name"] == "torchrevive-job"


def test_the_command_and_config_resolve_to_an_etcd3_job_on_all_three_members(job_yaml, monkeypatch):
    sources: dict[str, str] = {}
    config = load_config(job_yaml, sources)
    validate(config, sources)
    request, argv = resolved_job(job_yaml, monkeypatch)
    resolved = request.config
    policy = document("PyTorchJob")["spec"]["elasticPolicy"]
    assert resolved.rendezvous.backend == "etcd3"
    assert parse_endpoints(resolved.rendezvous.endpoint) == etcd_client_endpoints()
    assert parse_endpoints(config.rendezvous.endpoint) == etcd_client_endpoints()
    assert resolved.job.nnodes == f"{policy['minReplicas']}:{policy['maxReplicas']}"
    nproc = int(document("PyTorchJob")["spec"]["nprocPerNode"])
    assert resolved.job.nproc_per_node == nproc == config.job.nproc_per_node
    assert resolved.checkpoint.dir.startswith(next(m["mountPath"] for m in pytorch_container()["volumeMounts"]
                                                   if m["name"] == "checkpoints"))
    assert request.script == "examples/train.py", shlex.join(argv)


Objects = dict[tuple[str, str], dict[str, Any]]
"""Secrets and ConfigMaps by (kind, name)."""


class LocalEtcdCluster:
    """The StatefulSet's members as processes here: each its pod's command line, volumes and
    environment (pod IP 127.0.0.1), every member's DNS name and port mapped to 127.0.0.1 and a free
    port of its own."""

    def __init__(self, root: Path, objects: Objects) -> None:
        etcd, service = document("StatefulSet"), document("Service")
        self.names = [f"{etcd['metadata']['name']}-{i}" for i in range(etcd["spec"]["replicas"])]
        self.service = service["metadata"]["name"]
        self.ports = {name: {p["port"]: free_port() for p in service["spec"]["ports"]} for name in self.names}
        self.root, self.objects = root, objects
        self.processes: list[subprocess.Popen] = []

    def address(self, host: str, port: int, own: str | None = None) -> str | None:
        """127.0.0.1:PORT for a member's name (or, in member ``own``'s command, its pod IP) and port."""
        for name in self.names:
            if host == f"{name}.{self.service}" or (host == POD_IP and name == own):
                return f"{POD_IP}:{self.ports[name][port]}"
        return None

    def command(self, name: str) -> list[str]:
        pod = etcd_pod()
        (container,) = pod["containers"]
        env = container_env(container, {"metadata.name": name, "status.podIP": POD_IP})
        mounts = mount_volumes(pod, container, self.root / name, self.objects)
        return [map_addresses(local_paths(expand(arg, env), mounts), lambda h, p: self.address(h, p, own=name))
                for arg in container["command"]]

    def start(self) -> None:
        for name in self.names:
            command = self.command(name)
            with open(self.root / f"{name}.log", "wb") as log:  # the process keeps its own descriptor
                self.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.wait(timeout=30)

    def logs(self) -> str:
        return "\n".join((self.root / f"{name}.log").read_text()[-2000:] for name in self.names)


def run_auth_job(cluster: LocalEtcdCluster, root: Path, objects: Objects,
                 timeout: float = 90) -> str:
    """The auth Job's container here, retried as its backoffLimit does until etcd has formed."""
    pod = auth_job_pod()
    (container,) = pod["containers"]
    env = container_env(container, {"status.podIP": POD_IP})
    mounts = mount_volumes(pod, container, root, objects)
    env = {k: map_addresses(local_paths(v, mounts), cluster.address) for k, v in env.items()}
    command = [local_paths(arg, mounts) for arg in container["command"]]
    assert command[0] == "python"
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=120,
                              env={"PATH": os.environ["PATH"], **env})
        if done.returncode == 0:
            return done.stdout
        if time.monotonic() > deadline:
            raise AssertionError(f"the auth Job failed: {done.stderr[-3000:]}\n{cluster.logs()}")
        time.sleep(1)


def agent_parameters(cluster: LocalEtcdCluster, root: Path, job_yaml: Path,
                     monkeypatch: pytest.MonkeyPatch, **conf: Any) -> RendezvousParameters:
    """The rendezvous parameters a worker pod's agent builds from the job config, here."""
    request, _ = resolved_job(job_yaml, monkeypatch)
    mounts = mount_volumes(worker_pod(), pytorch_container(), root, cluster.objects)
    resolved = {k: local_paths(v, mounts) if isinstance(v, str) else v
                for k, v in {**request.config.rendezvous.conf, **conf}.items()}
    endpoint = map_addresses(request.config.rendezvous.endpoint, cluster.address)
    return RendezvousParameters(backend="etcd3", endpoint=endpoint, run_id=request.config.job.id, min_nodes=1,
                                max_nodes=1, **rdzv_conf_for_torch(resolved))


def with_password(objects: Objects, password: str) -> Objects:
    """``objects`` with the agents' password in the Secret torchrevive-etcd-auth replaced."""
    changed = copy.deepcopy(objects)
    changed["Secret", "torchrevive-etcd-auth"]["data"]["password"] = base64.b64encode(password.encode()).decode()
    return changed


@pytest.mark.skipif(not etcd_available(), reason="needs the etcd binary (Debian's etcd-server)")
def test_as_deployed_etcd_admits_only_tls_clients_with_a_certificate_and_the_jobs_password(
        tmp_path, secrets, job_yaml, monkeypatch):
    objects = {("Secret", name): s for name, s in secrets.items()}
    objects |= {(d["kind"], d["metadata"]["name"]): d for d in documents() if d["kind"] == "ConfigMap"}
    cluster = LocalEtcdCluster(tmp_path / "etcd", objects)
    try:
        cluster.start()  # the members' peer TLS, certificates and allowed CN: else no quorum, and the Job fails
        assert "authentication is on" in run_auth_job(cluster, tmp_path / "auth-job", objects)
        assert "authentication is on" in run_auth_job(cluster, tmp_path / "auth-job-again", objects)  # idempotent

        # An agent as deployed: TLS, its certificate, user and password; a whole rendezvous round.
        params = agent_parameters(cluster, tmp_path / "worker", job_yaml, monkeypatch)
        handler = create_etcd3_handler(params)
        assert handler.next_rendezvous().world_size == 1
        handler.shutdown()

        connection = Etcd3Connection(options_from(params))
        outside = Etcd3Store(connection, "/elsewhere", Etcd3Lease(connection, 10), timedelta(seconds=5))
        with pytest.raises(grpc.RpcError, match="permission denied"):  # only the job's prefix
            outside.set("key", "value")

        # The same member, straight: it answers the agents' credentials, and nothing less.
        etcd3 = import_etcd3()
        host, port = cluster.address(f"{cluster.names[0]}.{cluster.service}", 2379).split(":")
        options = options_from(params)
        certificate = {"ca_cert": options.ca_cert, "cert_cert": options.cert, "cert_key": options.cert_key}
        with etcd3.client(host=host, port=int(port), timeout=5, user=options.user, password=options.password,
                          **certificate) as client:
            client.get(f"{DEFAULT_PREFIX}/x")
        with etcd3.client(host=host, port=int(port), timeout=5, **certificate) as client:
            with pytest.raises(grpc.RpcError, match="permission denied"):  # the certificate without the password
                client.get(f"{DEFAULT_PREFIX}/x")
        for tls in ({"ca_cert": options.ca_cert}, {}):  # TLS without a client certificate; plaintext
            with etcd3.client(host=host, port=int(port), timeout=5, **tls) as client:
                with pytest.raises(etcd3.exceptions.ConnectionFailedError):
                    client.get(f"{DEFAULT_PREFIX}/x")

        # A changed password in the Secret: the Job, run again, applies it; the old one is refused.
        run_auth_job(cluster, tmp_path / "auth-job-rotated", with_password(objects, "rotated"))
        rotated = tmp_path / "rotated-password"
        rotated.write_text("rotated\n")
        new = agent_parameters(cluster, tmp_path / "worker", job_yaml, monkeypatch, password_file=str(rotated))
        Etcd3Connection(options_from(new)).call(lambda c: c.get(f"{DEFAULT_PREFIX}/x"))
        old = agent_parameters(cluster, tmp_path / "worker", job_yaml, monkeypatch, read_timeout=5)
        with pytest.raises(RendezvousConnectionError, match="refused user 'torchrevive'"):
            Etcd3Connection(options_from(old)).call(lambda c: c.get(f"{DEFAULT_PREFIX}/x"))
    finally:
        cluster.stop()
