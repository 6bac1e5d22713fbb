"""Strict validation of Kubernetes manifests against published schemas vendored in
tests/data/k8s_schemas (see its README): Kubernetes' own JSON schemas for the built-in kinds, and
the Kubeflow training operator's PyTorchJob CRD, whose pod templates are checked against
Kubernetes' PodTemplateSpec as well."""

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
OBJECT_META = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


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
    crd = yaml.safe_load(PYTORCHJOB_CRD.read_text())
    group, _, version = api_version.partition("/")
    if crd["spec"]["group"] != group or crd["spec"]["names"]["kind"] != kind:
        raise ValueError(f"{PYTORCHJOB_CRD} defines {crd['spec']['group']}/{crd['spec']['names']['kind']}, not {group}/{kind}")
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    if version not in served:
        raise ValueError(f"{PYTORCHJOB_CRD} serves {kind} versions {sorted(served)}, not '{version}'")
    schema = strict_structural_schema(served[version]["schema"]["openAPIV3Schema"])
    return jsonschema.Draft202012Validator(schema)


def _messages(validator: jsonschema.Draft202012Validator, instance: Any, where: str, source: str) -> list[str]:
    errors = sorted(validator.iter_errors(instance), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join([where, *map(str, e.absolute_path)])}: {e.message} ({source})" for e in errors]


def pod_template_errors(template: dict[str, Any], where: str = "template") -> list[str]:
    """What Kubernetes' PodTemplateSpec schema rejects in `template`, one message per error."""
    return _messages(_kubernetes_validator(_kind_schema(POD_TEMPLATE_SPEC)), template, where, POD_TEMPLATE_SPEC)


def manifest_errors(doc: dict[str, Any]) -> list[str]:
    """What the published schemas reject in one manifest document; each message names the
    object, the field path and the problem. An empty list means the document is valid."""
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    name = f"{kind} {doc.get('metadata', {}).get('name', '?')}"
    if (api_version, kind) in KUBERNETES_KINDS:
        filename = KUBERNETES_KINDS[api_version, kind]
        return _messages(_kubernetes_validator(_kind_schema(filename)), doc, name, filename)
    if kind == "PyTorchJob":
        errors = _messages(_crd_validator(api_version, kind), doc, name, PYTORCHJOB_CRD.name)
        # The API server checks every custom object's metadata as ObjectMeta; the CRD says only "object".
        errors += _messages(_kubernetes_validator({"$ref": OBJECT_META}), doc.get("metadata"), f"{name}.metadata",
                            "ObjectMeta in _definitions.json")
        # Some CRD versions keep pod templates as unknown fields, so check them against Kubernetes too.
        for role, spec in (doc.get("spec", {}).get("pytorchReplicaSpecs") or {}).items():
            if isinstance(spec, dict) and "template" in spec:
                errors += pod_template_errors(spec["template"], f"{name}.spec.pytorchReplicaSpecs.{role}.template")
        return errors
    raise ValueError(f"no vendored schema for apiVersion '{api_version}' kind '{kind}': add it to {SCHEMAS} "
                     "(see its README) and to tests/k8s_schemas.py")
