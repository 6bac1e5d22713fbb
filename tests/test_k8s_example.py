"""The Kubernetes example (configs/k8s/pytorchjob.yaml) validates: the manifests' structure as the
Kubeflow training operator and Kubernetes need it, the job config through our own loader, and the
container's command line through `torchrevive run`'s parser with the PET_* variables the operator
injects."""

from __future__ import annotations

import shlex

import yaml
from conftest import REPO

from agent.config import load_config, validate
from launcher.torchrun_flags import parse_run_args

MANIFEST = REPO / "configs" / "k8s" / "pytorchjob.yaml"


def manifests() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc.get("kind")
    return {doc["kind"]: doc for doc in docs}


def test_the_pytorchjob_is_an_elastic_job_the_operator_accepts():
    job = manifests()["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    policy = job["spec"]["elasticPolicy"]
    assert 1 <= policy["minReplicas"] <= policy["maxReplicas"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    assert worker["restartPolicy"] in {"OnFailure", "Never", "Always", "ExitCode"}
    container = next(c for c in worker["template"]["spec"]["containers"] if c["name"] == "pytorch")
    assert container["command"][:2] == ["torchrevive", "run"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in worker["template"]["spec"]["volumes"]}
    assert set(mounts) == set(volumes)
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == manifests()["PersistentVolumeClaim"]["metadata"]["name"]
    assert volumes["job-config"]["configMap"]["name"] == manifests()["ConfigMap"]["metadata"]["name"]


def test_the_command_and_config_resolve_to_an_etcd3_job(tmp_path, monkeypatch):
    kinds = manifests()
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(kinds["ConfigMap"]["data"]["job.yaml"])
    sources: dict[str, str] = {}
    config = load_config(job_yaml, sources)
    validate(config, sources)
    container = kinds["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "job-config")
    argv = [str(job_yaml) if a == f"{mount}/job.yaml" else a for a in container["command"][2:]]
    # What the operator injects for an elastic PyTorchJob (flags on the command line win).
    policy = kinds["PyTorchJob"]["spec"]["elasticPolicy"]
    for name, value in {"PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
                        "PET_NPROC_PER_NODE": str(policy["nProcPerNode"]), "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
                        "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "torchrevive-example-worker-0:23456"}.items():
        monkeypatch.setenv(name, value)
    request = parse_run_args(argv)
    resolved = request.config
    service = kinds["Service"]
    assert resolved.rendezvous.backend == "etcd3"
    assert resolved.rendezvous.endpoint == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert resolved.job.nnodes == f"{policy['minReplicas']}:{policy['maxReplicas']}"
    assert resolved.job.nproc_per_node == policy["nProcPerNode"] == config.job.nproc_per_node
    assert resolved.checkpoint.dir.startswith(next(m["mountPath"] for m in container["volumeMounts"]
                                                   if m["name"] == "checkpoints"))
    assert request.script == "examples/train.py", shlex.join(argv)
