"""Which connections Kubernetes NetworkPolicies admit into a pod, as the API documents them
(kubernetes.io/docs/concepts/services-networking/network-policies): a pod selected by a policy
whose policyTypes include Ingress accepts only what some such policy's ingress rule allows; a pod
no policy selects accepts everything. Enough for the example's policies (label selectors, namespace
selectors, numeric ports); anything else it does not model is an error, never a silent answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pod:
    """A pod by its labels and its namespace (name and labels; Kubernetes labels every namespace
    with ``kubernetes.io/metadata.name``)."""

    labels: dict[str, str]
    namespace: str = "default"
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def namespace_labels_with_name(self) -> dict[str, str]:
        return {**self.namespace_labels, "kubernetes.io/metadata.name": self.namespace}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector matches ``labels`` (an empty selector matches everything)."""
    unknown = selector.keys() - {"matchLabels", "matchExpressions"}
    if unknown:
        raise ValueError(f"selector fields {sorted(unknown)} are not modelled")
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        matched = {"In": lambda: labels.get(key) in values, "NotIn": lambda: labels.get(key) not in values,
                   "Exists": lambda: key in labels, "DoesNotExist": lambda: key not in labels}[operator]()
        if not matched:
            return False
    return True


def _isolates_ingress(policy: dict[str, Any]) -> bool:
    # policyTypes defaults to Ingress (plus Egress when there are egress rules).
    return "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])


def _peer_matches(peer: dict[str, Any], source: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer or peer.keys() - {"podSelector", "namespaceSelector"}:
        raise ValueError(f"peer {peer} is not modelled")
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], source.namespace_labels_with_name()):
            return False
    elif source.namespace != policy_namespace:  # a podSelector alone means the policy's namespace
        return False
    return selects(peer.get("podSelector", {}), source.labels)


def _port_matches(entry: dict[str, Any], port: int) -> bool:
    if entry.get("protocol", "TCP") != "TCP":
        return False
    if "port" not in entry:
        return True
    if not isinstance(entry["port"], int):
        raise ValueError(f"named port {entry['port']!r} is not modelled")
    return entry["port"] <= port <= entry.get("endPort", entry["port"])


def _rule_admits(rule: dict[str, Any], source: Pod, port: int, policy_namespace: str) -> bool:
    peers, ports = rule.get("from"), rule.get("ports")
    from_ok = not peers or any(_peer_matches(p, source, policy_namespace) for p in peers)
    port_ok = not ports or any(_port_matches(p, port) for p in ports)
    return from_ok and port_ok


def _selecting(policies: list[dict[str, Any]], target: Pod) -> list[dict[str, Any]]:
    """The policies that select ``target`` for ingress."""
    return [p for p in policies if _isolates_ingress(p)
            and p["metadata"].get("namespace", "default") == target.namespace
            and selects(p["spec"]["podSelector"], target.labels)]


def isolated(policies: list[dict[str, Any]], target: Pod) -> bool:
    """Whether some policy selects ``target`` for ingress (so it refuses what none admits)."""
    return bool(_selecting(policies, target))


def admits(policies: list[dict[str, Any]], source: Pod, target: Pod, port: int) -> bool:
    """Whether a TCP connection from ``source`` to ``target``'s ``port`` is allowed."""
    selecting = _selecting(policies, target)
    return not selecting or any(_rule_admits(rule, source, port, target.namespace)
                                for policy in selecting for rule in policy["spec"].get("ingress") or [])
