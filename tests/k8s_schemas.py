"""Strict validation of Kubernetes manifests against published schemas vendored in
tests/data/k8s_schemas (see its README): Kubernetes' own JSON schemas for the built-in kinds, and
the CRDs of the Kubeflow training operator (PyTorchJob), JobSet (JobSet) and Kubeflow Trainer v2
(TrainJob, TrainingRuntime), whose embedded Job and pod templates are checked against
Kubernetes' JobTemplateSpec and PodTemplateSpec as well."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

SCHEMAS = Path(__file__).resolve().parent / "data" / "k8s_schemas"
KUBERNETES = SCHEMAS / "kubernetes-v1.34.0"
PYTORCHJOB_CRD = SCHEMAS / "kubeflow.org_pytorchjobs.yaml"
JOBSET_CRD = SCHEMAS / "jobset.x-k8s.io_jobsets.yaml"
TRAINJOB_CRD = SCHEMAS / "trainer.kubeflow.org_trainjobs.yaml"
TRAININGRUNTIME_CRD = SCHEMAS / "trainer.kubeflow.org_trainingruntimes.yaml"

# kind -> the vendored CRD that defines it (its group and served versions are checked too).
CRDS = {
    "PyTorchJob": PYTORCHJOB_CRD,
    "JobSet": JOBSET_CRD,
    "TrainJob": TRAINJOB_CRD,
    "TrainingRuntime": TRAININGRUNTIME_CRD,
}

# (apiVersion, kind) -> the vendored Kubernetes schema file for it.
KUBERNETES_KINDS = {
    ("v1", "ConfigMap"): "configmap-v1.json",
    ("v1", "Service"): "service-v1.json",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaim-v1.json",
    ("apps/v1", "StatefulSet"): "statefulset-apps-v1.json",
    ("v1", "Secret"): "secret-v1.json",
    ("batch/v1", "Job"): "job-batch-v1.json",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicy-networking-v1.json",
}
POD_TEMPLATE_SPEC = "podtemplatespec-v1.json"
DEFINITIONS = "https://kubernetes.io/api/_definitions.json#/$defs/"
OBJECT_META = DEFINITIONS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
JOB_TEMPLATE_SPEC = DEFINITIONS + "io.k8s.api.batch.v1.JobTemplateSpec"


@cache
def _kubernetes_registry() -> Registry:
    """Every vendored Kubernetes schema, by its $id (the kind files refer to _definitions.json)."""
    resources = [Resource.from_contents(json.loads(path.read_text())) for path in sorted(KUBERNETES.glob("*.json"))]
    return Registry().with_resources((resource.id(), resource) for resource in resources)


def _kubernetes_validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema, registry=_kubernetes_registry())


def _kind_schema(filename: str) -> dict[str, Any]:
    return json.loads((KUBERNETES / filename).read_text())


def strict_structural_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's openAPIV3Schema as the API server applies it with strict field validation (kubectl's
    default): an object's fields outside its `properties` are rejected, unless the schema allows
    them (`additionalProperties`) or keeps them (`x-kubernetes-preserve-unknown-fields`)."""
    strict = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(strict)
    return strict


@cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    path = CRDS[kind]
    crd = yaml.safe_load(path.read_text())
    group, _, version = api_version.partition("/")
    if crd["spec"]["group"] != group or crd["spec"]["names"]["kind"] != kind:
        raise ValueError(f"{path} defines {crd['spec']['group']}/{crd['spec']['names']['kind']}, not {group}/{kind}")
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    if version not in served:
        raise ValueError(f"{path} serves {kind} versions {sorted(served)}, not '{version}'")
    schema = strict_structural_schema(served[version]["schema"]["openAPIV3Schema"])
    return jsonschema.Draft202012Validator(schema)


def _messages(validator: jsonschema.Draft202012Validator, instance: Any, where: str, source: str) -> list[str]:
    errors = sorted(validator.iter_errors(instance), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join([where, *map(str, e.absolute_path)])}: {e.message} ({source})" for e in errors]


def pod_template_errors(template: dict[str, Any], where: str = "template") -> list[str]:
    """What Kubernetes' PodTemplateSpec schema rejects in `template`, one message per error."""
    return _messages(_kubernetes_validator(_kind_schema(POD_TEMPLATE_SPEC)), template, where, POD_TEMPLATE_SPEC)


def job_template_errors(template: dict[str, Any], where: str = "template") -> list[str]:
    """What Kubernetes rejects in a Job template embedded in a JobSet: the Job's fields against
    JobTemplateSpec, and its pod template against PodTemplateSpec (one message per error)."""
    job = copy.deepcopy(template)
    pod = (job.get("spec") or {}).get("template")
    if pod is not None:
        job["spec"]["template"] = {}  # an empty PodTemplateSpec is valid: the pod is checked below
    errors = _messages(_kubernetes_validator({"$ref": JOB_TEMPLATE_SPEC}), job, where,
                       "JobTemplateSpec in _definitions.json")
    if pod is not None:
        errors += pod_template_errors(pod, f"{where}.spec.template")
    return errors


def _embedded_template_errors(doc: dict[str, Any], name: str) -> list[str]:
    """Kubernetes' checks of the Job and pod templates a custom object embeds: some CRD versions
    keep them as unknown fields, and a CRD may lag behind Kubernetes' own types."""
    spec = doc.get("spec") or {}
    if doc["kind"] == "PyTorchJob":
        return [error for role, replica in (spec.get("pytorchReplicaSpecs") or {}).items()
                if isinstance(replica, dict) and "template" in replica
                for error in pod_template_errors(replica["template"],
                                                 f"{name}.spec.pytorchReplicaSpecs.{role}.template")]
    if doc["kind"] == "JobSet":
        jobset, where = spec, f"{name}.spec"
    elif doc["kind"] == "TrainingRuntime":
        jobset, where = (spec.get("template") or {}).get("spec") or {}, f"{name}.spec.template.spec"
    else:  # TrainJob: no templates, only the runtime's name and overrides
        return []
    return [error for index, replicated in enumerate(jobset.get("replicatedJobs") or [])
            if isinstance(replicated, dict) and "template" in replicated
            for error in job_template_errors(replicated["template"], f"{where}.replicatedJobs.{index}.template")]


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """What the vendored CRD of the document's kind alone rejects in it (strictly)."""
    name = f"{doc['kind']} {doc.get('metadata', {}).get('name', '?')}"
    return _messages(_crd_validator(doc["apiVersion"], doc["kind"]), doc, name, CRDS[doc["kind"]].name)


def manifest_errors(doc: dict[str, Any]) -> list[str]:
    """What the published schemas reject in one manifest document; each message names the
    object, the field path and the problem. An empty list means the document is valid."""
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    name = f"{kind} {doc.get('metadata', {}).get('name', '?')}"
    if (api_version, kind) in KUBERNETES_KINDS:
        filename = KUBERNETES_KINDS[api_version, kind]
        return _messages(_kubernetes_validator(_kind_schema(filename)), doc, name, filename)
    if kind in CRDS:
        errors = crd_errors(doc)
        # The API server checks every custom object's metadata as ObjectMeta; the CRD says only "object".
        errors += _messages(_kubernetes_validator({"$ref": OBJECT_META}), doc.get("metadata"), f"{name}.metadata",
                            "ObjectMeta in _definitions.json")
        return errors + _embedded_template_errors(doc, name)
    raise ValueError(f"no vendored schema for apiVersion '{api_version}' kind '{kind}': add it to {SCHEMAS} "
                     "(see its README) and to tests/k8s_schemas.py")
