"""The Kubernetes example (configs/k8s/pytorchjob.yaml) validates: every document against the
published schema of its kind (Kubernetes' own, and the Kubeflow training operator's PyTorchJob
CRD, vendored in tests/data/k8s_schemas), strictly, so a misspelt field fails; the 3-member etcd
cluster and the job's endpoints agree; the worker pod runs as the image's user with a
memory-backed /dev/shm; the job config loads through our own loader, and the container's command
line parses through `torchrevive run`'s parser with the PET_* variables the operator injects."""

from __future__ import annotations

import copy
import re
import shlex
from typing import Any

import pytest
import yaml
from conftest import REPO
from dockerfile import numeric_uid, parse_dockerfile
from k8s_schemas import manifest_errors, pod_template_errors, strict_structural_schema

from agent.config import load_config, parse_endpoints, validate
from launcher.torchrun_flags import parse_run_args

MANIFEST = REPO / "configs" / "k8s" / "pytorchjob.yaml"


def manifests() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    kinds = {doc["kind"]: doc for doc in docs}
    assert len(kinds) == len(docs), "one document per kind"
    return kinds


def worker_pod(kinds: dict[str, dict]) -> dict[str, Any]:
    return kinds["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def pytorch_container(kinds: dict[str, dict]) -> dict[str, Any]:
    return next(c for c in worker_pod(kinds)["containers"] if c["name"] == "pytorch")


@pytest.mark.parametrize("kind", ["ConfigMap", "PersistentVolumeClaim", "Service", "StatefulSet", "PyTorchJob"])
def test_each_document_is_valid_against_its_published_schema(kind):
    assert manifest_errors(manifests()[kind]) == []


def edit(kind: str, path: str, value: Any = None, rename: str | None = None) -> dict[str, Any]:
    """A copy of the manifest's `kind` document with the field at dotted `path` set to `value`,
    or renamed to `rename`."""
    doc = copy.deepcopy(manifests()[kind])
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
    (edit("StatefulSet", "spec.replicas", "three"), "StatefulSet torchrevive-etcd.spec.replicas: 'three' is not of type"),
    (edit("Service", "spec.ports.0.port", "2379"), "Service torchrevive-etcd.spec.ports.0.port: '2379' is not of type"),
    (edit("PersistentVolumeClaim", "spec.accessModes", rename="accessMode"), "('accessMode' was unexpected)"),
    (edit("ConfigMap", "metadata.name", rename="nmae"), "ConfigMap ?.metadata: Additional properties are not allowed"),
    (edit("PyTorchJob", "spec.pytorchReplicaSpecs.Worker.replicas", rename="replica"),
     "PyTorchJob torchrevive-example.spec.pytorchReplicaSpecs.Worker: Additional properties are not allowed "
     "('replica' was unexpected) (kubeflow.org_pytorchjobs.yaml)"),
    (edit("PyTorchJob", "spec.elasticPolicy.minReplicas", "2"),
     "PyTorchJob torchrevive-example.spec.elasticPolicy.minReplicas: '2' is not of type 'integer'"),
    (edit("PyTorchJob", "spec.elasticPolicy.nProcsPerNode", 8), "('nProcsPerNode' was unexpected)"),
    (edit("PyTorchJob", "spec.pytorchReplicaSpecs.Worker.template.spec.volumes.2.emptyDir.medium", rename="meduim"),
     "('meduim' was unexpected) (podtemplatespec-v1.json)"),
    (edit("PyTorchJob", "metadata.labl", {}), "('labl' was unexpected) (ObjectMeta in _definitions.json)"),
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
    template = copy.deepcopy(manifests()["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"])
    assert pod_template_errors(template) == []
    template["spec"]["containers"][0]["volumeMount"] = template["spec"]["containers"][0].pop("volumeMounts")
    assert pod_template_errors(template) == [
        "template.spec.containers.0: Additional properties are not allowed ('volumeMount' was unexpected) "
        "(podtemplatespec-v1.json)"]


def test_an_unknown_kind_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"apiVersion 'batch/v1' kind 'Job'"):
        manifest_errors({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}})


def test_etcd_runs_three_members_that_know_each_other_by_stable_names():
    kinds = manifests()
    etcd, service = kinds["StatefulSet"], kinds["Service"]
    assert etcd["spec"]["replicas"] == 3
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert etcd["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    names = [f"{etcd['metadata']['name']}-{i}" for i in range(etcd["spec"]["replicas"])]
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in container["command"][1:])
    assert flags["initial-cluster"].split(",") == [f"{n}=http://{n}.{service['metadata']['name']}:{ports['peer']}"
                                                   for n in names]
    assert flags["name"] == "$(POD_NAME)" and {"name": "POD_NAME", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.name"}}} in container["env"]
    assert flags["initial-advertise-peer-urls"] == f"http://$(POD_NAME).{service['metadata']['name']}:{ports['peer']}"
    (data,) = etcd["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert flags["data-dir"].startswith(mounts[data["metadata"]["name"]] + "/")


def etcd_client_endpoints(kinds: dict[str, dict]) -> list[tuple[str, int]]:
    etcd, service = kinds["StatefulSet"], kinds["Service"]
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "client")
    return [(f"{etcd['metadata']['name']}-{i}.{service['metadata']['name']}", port) for i in range(etcd["spec"]["replicas"])]


def test_the_worker_pod_runs_as_the_images_user_with_a_memory_backed_dev_shm():
    kinds = manifests()
    pod = worker_pod(kinds)
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] == context["fsGroup"] == numeric_uid(parse_dockerfile(REPO / "Dockerfile")[-1])
    container = pytorch_container(kinds)
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    (shm,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm]["emptyDir"]["medium"] == "Memory"
    assert re.fullmatch(r"\d+Gi", volumes[shm]["emptyDir"]["sizeLimit"])


def test_the_pytorchjob_is_an_elastic_job_the_operator_accepts():
    kinds = manifests()
    job = kinds["PyTorchJob"]
    policy = job["spec"]["elasticPolicy"]
    assert 1 <= policy["minReplicas"] <= policy["maxReplicas"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    assert worker["restartPolicy"] in {"OnFailure", "Never", "Always", "ExitCode"}
    container = pytorch_container(kinds)
    assert container["command"][:2] == ["torchrevive", "run"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in worker_pod(kinds)["volumes"]}
    assert set(mounts) == set(volumes)
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == kinds["PersistentVolumeClaim"]["metadata"]["name"]
    assert volumes["job-config"]["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]


def test_the_command_and_config_resolve_to_an_etcd3_job_on_all_three_members(tmp_path, monkeypatch):
    kinds = manifests()
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(kinds["ConfigMap"]["data"]["job.yaml"])
    sources: dict[str, str] = {}
    config = load_config(job_yaml, sources)
    validate(config, sources)
    container = pytorch_container(kinds)
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "job-config")
    argv = [str(job_yaml) if a == f"{mount}/job.yaml" else a for a in container["command"][2:]]
    # What the operator injects for an elastic PyTorchJob (flags on the command line win).
    spec = kinds["PyTorchJob"]["spec"]
    policy = spec["elasticPolicy"]
    for name, value in {"PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
                        "PET_NPROC_PER_NODE": spec["nprocPerNode"], "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
                        "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "torchrevive-example-worker-0:23456"}.items():
        monkeypatch.setenv(name, value)
    request = parse_run_args(argv)
    resolved = request.config
    assert resolved.rendezvous.backend == "etcd3"
    assert parse_endpoints(resolved.rendezvous.endpoint) == etcd_client_endpoints(kinds)
    assert parse_endpoints(config.rendezvous.endpoint) == etcd_client_endpoints(kinds)
    assert resolved.job.nnodes == f"{policy['minReplicas']}:{policy['maxReplicas']}"
    assert resolved.job.nproc_per_node == int(spec["nprocPerNode"]) == config.job.nproc_per_node
    assert resolved.checkpoint.dir.startswith(next(m["mountPath"] for m in container["volumeMounts"]
                                                   if m["name"] == "checkpoints"))
    assert request.script == "examples/train.py", shlex.join(argv)
