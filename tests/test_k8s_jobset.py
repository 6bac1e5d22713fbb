"""The current-generation Kubernetes examples: configs/k8s/jobset.yaml (an elastic job on JobSet,
with the etcd3 rendezvous of pytorchjob.yaml) and configs/k8s/trainjob.yaml (a fixed-size job on
Kubeflow Trainer v2: a TrainingRuntime and a TrainJob). Every document validates strictly against
its published schema (the JobSet and Trainer v2 CRDs vendored in tests/data/k8s_schemas, embedded
Job and pod templates against Kubernetes' own); misspelt fields and wrong types are rejected; the
pods run as the image's user with a memory-backed /dev/shm; the command is `torchrevive run` with
the job config, which loads through our own loader; the size torchrevive is given (`--nnodes`)
agrees with the size the operator runs; and the failure policy is one that JobSet's webhook
accepts and that leaves recovery from a lost pod to torchrevive."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO
from dockerfile import numeric_uid, parse_dockerfile
from k8s_local_pod import POD_IP, container_env, expand
from k8s_network_policies import Pod, admits, isolated
from k8s_schemas import crd_errors, manifest_errors
from test_k8s_example import secret_key

from agent.config import load_config, parse_endpoints, validate
from launcher.cli import run_command
from launcher.torchrun_flags import RunRequest, parse_run_args

K8S = REPO / "configs" / "k8s"
JOBSET, TRAINJOB, PYTORCHJOB = K8S / "jobset.yaml", K8S / "trainjob.yaml", K8S / "pytorchjob.yaml"
TRAINER_PORT = 29500  # Kubeflow Trainer v2.3.0's ContainerTrainerPort, PET_MASTER_PORT
FAILURE_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")  # JobSet's webhook


def documents(manifest: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(manifest.read_text()) if d]


def document(manifest: Path, kind: str, name: str | None = None) -> dict[str, Any]:
    """The manifest's one document of ``kind`` (named ``name`` where the kind has several)."""
    (found,) = [d for d in documents(manifest) if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return found


def jobset_workers() -> dict[str, Any]:
    """The JobSet's replicatedJob that runs the agents."""
    (workers,) = document(JOBSET, "JobSet")["spec"]["replicatedJobs"]
    return workers


def runtime_node() -> dict[str, Any]:
    """The TrainingRuntime's replicatedJob `node`, which Trainer fills in from the TrainJob."""
    (node,) = document(TRAINJOB, "TrainingRuntime")["spec"]["template"]["spec"]["replicatedJobs"]
    return node


def only_container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["containers"]
    return container


def config_file(manifest: Path, pod: dict[str, Any], container: dict[str, Any], path: str, tmp_path: Path) -> Path:
    """The job config a container reads at ``path``, from the ConfigMap volume mounted there, written here."""
    directory, _, filename = path.rpartition("/")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    data = document(manifest, "ConfigMap", volume["configMap"]["name"])["data"]
    local = tmp_path / filename
    local.write_text(data[filename])
    return local


def resolved(manifest: Path, pod: dict[str, Any], container: dict[str, Any], command: list[str], tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch, injected: dict[str, str]) -> RunRequest:
    """``command`` as `torchrevive run` resolves it on a pod whose IP is POD_IP, with the
    variables the operator ``injected`` (PET_* too, as torchrun reads them; flags win)."""
    assert command[:3] == ["torchrevive", "run", "--config"], command
    env = {**container_env(container, {"status.podIP": POD_IP}), **injected}
    local = config_file(manifest, pod, container, command[3], tmp_path)
    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    for name, value in injected.items():
        monkeypatch.setenv(name, value)
    return parse_run_args(["--config", str(local), *(expand(a, env) for a in command[4:])])


def jobset_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunRequest:
    """The JobSet's command line, resolved: JobSet injects no PET_* variables."""
    pod = jobset_workers()["template"]["spec"]["template"]["spec"]
    container = only_container(pod)
    return resolved(JOBSET, pod, container, container["command"], tmp_path, monkeypatch, {})


def trainer_env() -> dict[str, str]:
    """The PET_* variables Trainer v2's torch plugin injects into the container `node` of pod 1."""
    job = document(TRAINJOB, "TrainJob")
    trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
    return {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_NODE_RANK": "1", "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": str(TRAINER_PORT)}


def trainjob_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunRequest:
    """The TrainJob's command in the runtime's container `node`, resolved with Trainer's variables."""
    pod = runtime_node()["template"]["spec"]["template"]["spec"]
    command = document(TRAINJOB, "TrainJob")["spec"]["trainer"]["command"]
    return resolved(TRAINJOB, pod, only_container(pod), command, tmp_path, monkeypatch, trainer_env())


def nnodes_bounds(request: RunRequest) -> tuple[int, int]:
    low, _, high = request.config.job.nnodes.partition(":")
    return int(low), int(high or low)


@pytest.mark.parametrize("manifest, kind, name", [
    (m, d["kind"], d["metadata"]["name"]) for m in (JOBSET, TRAINJOB) for d in documents(m)])
def test_each_document_is_valid_against_its_published_schema(manifest, kind, name):
    assert manifest_errors(document(manifest, kind, name)) == []


def edit(manifest: Path, kind: str, path: str, value: Any = None, rename: str | None = None,
         name: str | None = None, delete: bool = False) -> dict[str, Any]:
    """A copy of the manifest's `kind` document with the field at dotted `path` set to `value`,
    renamed to `rename`, or deleted."""
    doc = copy.deepcopy(document(manifest, kind, name))
    *parents, key = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = doc
    for part in parents:
        node = node[part]
    if delete:
        del node[key]
    elif rename is not None:
        node[rename] = node.pop(key)
    else:
        node[key] = value
    return doc


JOBSET_POD = "spec.replicatedJobs.0.template.spec.template.spec"
RUNTIME_JOB = "spec.template.spec.replicatedJobs.0.template.spec"


@pytest.mark.parametrize("doc, expected", [
    (edit(JOBSET, "JobSet", "spec.replicatedJobs.0.replicas", rename="replica"),
     "JobSet torchrevive-example.spec.replicatedJobs.0: Additional properties are not allowed ('replica' was "
     "unexpected) (jobset.x-k8s.io_jobsets.yaml)"),
    (edit(JOBSET, "JobSet", "spec.replicatedJobs.0.template.spec.parallelism", "4"),
     "JobSet torchrevive-example.spec.replicatedJobs.0.template.spec.parallelism: '4' is not of type 'integer' "
     "(jobset.x-k8s.io_jobsets.yaml)"),
    (edit(JOBSET, "JobSet", "spec.failurePolicy.restartStrategy", "InPlace"),
     "JobSet torchrevive-example.spec.failurePolicy.restartStrategy: 'InPlace' is not one of"),
    (edit(JOBSET, "JobSet", "spec.failurePolicy.rules.0.action", "RestartPod"),
     "JobSet torchrevive-example.spec.failurePolicy.rules.0.action: 'RestartPod' is not one of"),
    (edit(JOBSET, "JobSet", "spec.failurePolicy.maxRestart", 3), "('maxRestart' was unexpected)"),
    (edit(JOBSET, "JobSet", f"{JOBSET_POD}.volumes.5.emptyDir.medium", rename="meduim"),
     f"JobSet torchrevive-example.{JOBSET_POD}.volumes.5.emptyDir: Additional properties are not allowed "
     "('meduim' was unexpected) (podtemplatespec-v1.json)"),
    (edit(JOBSET, "JobSet", f"{JOBSET_POD}.securityContext.runAsNonRoot", "true"),
     "securityContext.runAsNonRoot: 'true' is not of type 'boolean' (jobset.x-k8s.io_jobsets.yaml)"),
    (edit(JOBSET, "JobSet", "metadata.labl", {}), "('labl' was unexpected) (ObjectMeta in _definitions.json)"),
    (edit(TRAINJOB, "TrainJob", "spec.trainer.numNodes", "4"),
     "TrainJob torchrevive-trainjob.spec.trainer.numNodes: '4' is not of type 'integer' "
     "(trainer.kubeflow.org_trainjobs.yaml)"),
    (edit(TRAINJOB, "TrainJob", "spec.runtimeRef", rename="runtimeref"),
     "TrainJob torchrevive-trainjob.spec: 'runtimeRef' is a required property"),
    (edit(TRAINJOB, "TrainJob", "spec.trainer.nprocPerNode", 8), "('nprocPerNode' was unexpected)"),
    # Trainer v2.2 removed ElasticPolicy: a v2.0/v2.1 runtime that sets it is refused.
    (edit(TRAINJOB, "TrainingRuntime", "spec.mlPolicy.torch.elasticPolicy", {"minNodes": 2, "maxNodes": 8}),
     "TrainingRuntime torchrevive.spec.mlPolicy.torch: Additional properties are not allowed ('elasticPolicy' "
     "was unexpected) (trainer.kubeflow.org_trainingruntimes.yaml)"),
    (edit(TRAINJOB, "TrainingRuntime", f"{RUNTIME_JOB}.backoffLimit", "20"),
     f"TrainingRuntime torchrevive.{RUNTIME_JOB}.backoffLimit: '20' is not of type 'integer'"),
    (edit(TRAINJOB, "TrainingRuntime", f"{RUNTIME_JOB}.template.spec.containers.0.volumeMounts", rename="volumeMount"),
     "('volumeMount' was unexpected) (podtemplatespec-v1.json)"),
])
def test_a_misspelt_field_or_a_wrong_type_is_rejected_with_its_path(doc, expected):
    errors = manifest_errors(doc)
    assert any(expected in e for e in errors), errors


def test_job_templates_are_checked_by_kubernetes_schema_too():
    """A JobSet's CRD may accept what the Kubernetes it runs on refuses in the Jobs it creates:
    v1.34's Job asks for a pod condition's `status`, JobSet v0.12.0's CRD (from v1.36) does not."""
    path = "spec.replicatedJobs.0.template.spec.podFailurePolicy.rules.1.onPodConditions.0.status"
    doc = edit(JOBSET, "JobSet", path, delete=True)
    assert crd_errors(doc) == []
    assert manifest_errors(doc) == [
        "JobSet torchrevive-example.spec.replicatedJobs.0.template.spec.podFailurePolicy.rules.1.onPodConditions.0: "
        "'status' is a required property (JobTemplateSpec in _definitions.json)"]


@pytest.mark.parametrize("kind, api_version, expected", [
    ("JobSet", "jobset.x-k8s.io/v1", r"serves JobSet versions \['v1alpha2'\], not 'v1'"),
    ("TrainJob", "kubeflow.org/v1alpha1", r"defines trainer.kubeflow.org/TrainJob, not kubeflow.org/TrainJob"),
])
def test_a_wrong_api_version_is_an_error_naming_it(kind, api_version, expected):
    doc = {**document(JOBSET if kind == "JobSet" else TRAINJOB, kind), "apiVersion": api_version}
    with pytest.raises(ValueError, match=expected):
        manifest_errors(doc)


def test_jobset_shares_the_hardened_etcd_and_network_policies_of_the_pytorchjob_example():
    """The etcd cluster, its Secrets, the auth Job and the NetworkPolicies are pytorchjob.yaml's, which
    test_k8s_example.py checks in depth (TLS, passwords, a live cluster); the JobSet's pods carry the
    PyTorchJob pods' labels, so the policies treat them alike."""
    shared = {"ConfigMap", "PersistentVolumeClaim", "Service", "StatefulSet", "Job", "NetworkPolicy"}

    def parsed(doc: dict[str, Any]) -> dict[str, Any]:  # a job config's comments may differ
        data = {k: yaml.safe_load(v) if k.endswith(".yaml") else v for k, v in doc.get("data", {}).items()}
        return {**doc, "data": data} if "data" in doc else doc

    ours = [parsed(d) for d in documents(JOBSET) if d["kind"] in shared]
    theirs = [parsed(d) for d in documents(PYTORCHJOB) if d["kind"] in shared]
    assert len(ours) == 9 and ours == theirs
    assert {d["kind"] for d in documents(JOBSET)} == shared | {"JobSet"}
    worker = document(PYTORCHJOB, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]
    assert jobset_workers()["template"]["spec"]["template"]["metadata"]["labels"] == worker["labels"]


def test_the_agents_mount_the_etcd_tls_files_and_only_their_password(tmp_path, monkeypatch):
    request = jobset_request(tmp_path, monkeypatch)
    conf = request.config.rendezvous.conf
    pod = jobset_workers()["template"]["spec"]["template"]["spec"]
    container = only_container(pod)
    assert secret_key(pod, container, conf["ca_cert"]) == ("torchrevive-etcd-client-tls", "ca.crt")
    assert secret_key(pod, container, conf["ssl_cert"]) == ("torchrevive-etcd-client-tls", "tls.crt")
    assert secret_key(pod, container, conf["ssl_cert_key"]) == ("torchrevive-etcd-client-tls", "tls.key")
    assert secret_key(pod, container, conf["password_file"]) == ("torchrevive-etcd-auth", "password")
    assert "password" not in conf
    secrets = [v["secret"] for v in pod["volumes"] if "secret" in v]
    assert {s["secretName"] for s in secrets} == {"torchrevive-etcd-client-tls", "torchrevive-etcd-auth"}
    (auth,) = [s for s in secrets if s["secretName"] == "torchrevive-etcd-auth"]
    assert [item["key"] for item in auth["items"]] == ["password"]  # never root's
    mounts = [m for m in container["volumeMounts"] if m["name"] in {v["name"] for v in pod["volumes"] if "secret" in v}]
    assert mounts and all(m.get("readOnly") is True for m in mounts)


def job_pods() -> list[tuple[Path, dict[str, Any]]]:
    return [(JOBSET, jobset_workers()["template"]["spec"]["template"]["spec"]),
            (TRAINJOB, runtime_node()["template"]["spec"]["template"]["spec"])]


@pytest.mark.parametrize("manifest, pod", job_pods(), ids=["jobset", "trainjob"])
def test_the_pods_run_as_the_images_user_with_a_memory_backed_dev_shm(manifest, pod):
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] == context["fsGroup"] == numeric_uid(parse_dockerfile(REPO / "Dockerfile")[-1])
    assert pod["automountServiceAccountToken"] is False
    container = only_container(pod)
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (shm,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm]["emptyDir"]["medium"] == "Memory"
    assert re.fullmatch(r"\d+Gi", volumes[shm]["emptyDir"]["sizeLimit"])
    assert {m["name"] for m in container["volumeMounts"]} == set(volumes)
    claim = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)["persistentVolumeClaim"]["claimName"]
    assert claim == document(manifest, "PersistentVolumeClaim")["metadata"]["name"]
    assert "0.0.0.0" not in manifest.read_text()


def test_the_jobset_runs_torchrevive_with_its_config_on_the_etcd_members(tmp_path, monkeypatch):
    pod = jobset_workers()["template"]["spec"]["template"]["spec"]
    path = only_container(pod)["command"][3]
    sources: dict[str, str] = {}
    config = load_config(config_file(JOBSET, pod, only_container(pod), path, tmp_path), sources)
    validate(config, sources)
    request = jobset_request(tmp_path, monkeypatch)
    assert request.script == "examples/train.py"
    assert request.config.rendezvous.backend == "etcd3"
    etcd = document(JOBSET, "StatefulSet")
    members = [f"{etcd['metadata']['name']}-{i}.{etcd['spec']['serviceName']}" for i in range(etcd["spec"]["replicas"])]
    assert parse_endpoints(request.config.rendezvous.endpoint) == [(member, 2379) for member in members]
    assert request.config.launch.local_addr == request.config.observability.metrics_addr == POD_IP
    assert request.config.job.nproc_per_node == config.job.nproc_per_node
    gpus = only_container(pod)["resources"]["limits"]["nvidia.com/gpu"]
    assert request.config.job.nproc_per_node == gpus


def test_the_jobsets_size_is_elastic_within_torchrevives_nnodes(tmp_path, monkeypatch):
    """JobSet's elastic size is the Indexed Job's parallelism = completions (ElasticJobSet, KEP-463);
    `replicas` is immutable. JobSet knows no bounds: `--nnodes MIN:MAX` holds them, and the
    JobSet starts inside them, with room to shrink and grow."""
    workers = jobset_workers()
    job = workers["template"]["spec"]
    assert workers["replicas"] == 1
    assert job["completionMode"] == "Indexed"
    assert job["parallelism"] == job["completions"]
    low, high = nnodes_bounds(jobset_request(tmp_path, monkeypatch))
    assert 1 <= low < job["parallelism"] < high
    assert only_container(job["template"]["spec"])["command"].count("--nnodes") == 1


def failure_handling(jobset: dict[str, Any], job: dict[str, Any], container: str) -> None:
    """The policy both examples share: a lost pod is replaced alone (torchrevive re-forms the job),
    a configuration error fails everything at once, a failed Job recreates the set a few times;
    and what JobSet's webhook asks of it (rule names; no InPlaceRestart, whose group restarts and
    barrier would stop the survivors)."""
    policy = jobset["failurePolicy"]
    assert policy["restartStrategy"] == "Recreate" and 1 <= policy["maxRestarts"] <= 10
    assert [r["action"] for r in policy["rules"]] == ["FailJobSet"]
    assert policy["rules"][0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert all(FAILURE_RULE_NAME.fullmatch(r["name"]) for r in policy["rules"])
    assert job["backoffLimit"] >= 10 and job["podReplacementPolicy"] == "Failed"
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # what podFailurePolicy requires
    fail, ignore = job["podFailurePolicy"]["rules"]
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["containerName"] == container
    assert fail["onExitCodes"]["operator"] == "In"
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert {c["name"] for c in job["template"]["spec"]["containers"]} == {container}


def test_a_configuration_error_is_the_exit_code_the_pod_failure_policy_fails_on(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("job:\n  nproc_per_nod: 8\n")
    codes = {r["onExitCodes"]["values"][0] for r in [
        jobset_workers()["template"]["spec"]["podFailurePolicy"]["rules"][0],
        runtime_node()["template"]["spec"]["podFailurePolicy"]["rules"][0]]}
    assert codes == {run_command(["--config", str(bad), "train.py"])} == {2}
    assert run_command(["--config", str(bad), "--nnodes", "2:x", "train.py"]) == 2


def test_the_jobsets_failure_policy_leaves_a_lost_pod_to_torchrevive():
    jobset = document(JOBSET, "JobSet")["spec"]
    failure_handling(jobset, jobset_workers()["template"]["spec"], "torchrevive")


def test_the_training_runtime_is_what_trainer_v2s_torch_plugin_fills_in():
    runtime = document(TRAINJOB, "TrainingRuntime")
    assert runtime["spec"]["mlPolicy"]["torch"] == {}  # PET_* into the container `node`; no other policy
    assert set(runtime["spec"]["mlPolicy"]) == {"numNodes", "torch"}
    node = runtime_node()
    assert node["name"] == "node"
    assert node["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    assert only_container(node["template"]["spec"]["template"]["spec"])["name"] == "node"
    failure_handling(runtime["spec"]["template"]["spec"], node["template"]["spec"], "node")
    job = document(TRAINJOB, "TrainJob")["spec"]
    assert job["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                 "name": runtime["metadata"]["name"]}
    reserved = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
    assert not reserved & {v["name"] for v in job["trainer"].get("env", [])}  # Trainer refuses them


def test_the_trainjob_runs_torchrevive_at_its_fixed_size_with_c10d_on_pod_0(tmp_path, monkeypatch):
    trainer = document(TRAINJOB, "TrainJob")["spec"]["trainer"]
    pod = runtime_node()["template"]["spec"]["template"]["spec"]
    sources: dict[str, str] = {}
    config = load_config(config_file(TRAINJOB, pod, only_container(pod), trainer["command"][3], tmp_path), sources)
    validate(config, sources)
    request = trainjob_request(tmp_path, monkeypatch)
    assert nnodes_bounds(request) == (trainer["numNodes"], trainer["numNodes"])
    assert "--nnodes" in trainer["command"]  # stated, not only read from PET_NNODES
    assert request.config.job.nproc_per_node == trainer["numProcPerNode"] == config.job.nproc_per_node
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == trainer["numProcPerNode"]
    env = trainer_env()
    assert request.config.rendezvous.backend == "c10d"
    assert parse_endpoints(request.config.rendezvous.endpoint) == [(env["PET_MASTER_ADDR"], TRAINER_PORT)]
    assert request.config.launch.local_addr == request.config.observability.metrics_addr == POD_IP
    assert request.script == "examples/train.py"
    ports = {p["name"]: p["containerPort"] for p in only_container(pod)["ports"]}
    assert ports["metrics"] == request.config.observability.metrics_port and TRAINER_PORT not in ports.values()


@pytest.mark.parametrize("source, port, admitted", [
    ({"app": "torchrevive-trainjob"}, 45123, True),
    ({"app": "torchrevive-trainjob"}, TRAINER_PORT, True),
    ({"app": "torchrevive-example"}, TRAINER_PORT, False),  # another example's pods
    ({"app": "web"}, 9400, False),
])
def test_the_trainjobs_pods_admit_each_other_and_nobody_else(source, port, admitted):
    policies = [d for d in documents(TRAINJOB) if d["kind"] == "NetworkPolicy"]
    pod = runtime_node()["template"]["spec"]["template"]
    target = Pod(pod["metadata"]["labels"])
    assert isolated(policies, target)
    assert admits(policies, Pod(source), target, port) is admitted
    monitoring = Pod({"app": "prometheus"}, namespace="monitoring")
    assert admits(policies, monitoring, target, 9400) and not admits(policies, monitoring, target, 45123)
