"""A Kubernetes example's container, run on this machine as the kubelet would set it up: its
environment (values and the downward API), `$(VAR)` expansion in its command, and its volumes
(Secrets and ConfigMaps written out as files, other volumes as empty directories) under a local
directory, with the container's paths rewritten to them. Services' DNS names are the caller's to
map (see :func:`map_addresses`)."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

POD_IP = "127.0.0.1"
"""The address a pod's downward API `status.podIP` gives here."""

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")
_ADDRESS = re.compile(r"([A-Za-z0-9][A-Za-z0-9.\-]*):(\d+)")


def container_env(container: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    """The container's variables: plain values (expanded as Kubernetes does), and downward-API
    fields from ``fields`` (fieldPath -> value)."""
    env: dict[str, str] = {}
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = expand(variable["value"], env)
        else:
            env[variable["name"]] = fields[variable["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion: `$(NAME)` becomes the variable's value when it is defined (else
    stays as written), `$$` becomes `$`."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(replace, text)


def mount_volumes(pod: dict[str, Any], container: dict[str, Any], root: Path,
                  objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Path]:
    """Write the container's volumes under ``root``; mountPath -> the local directory. ``objects``
    are the Secrets and ConfigMaps by (kind, name)."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        local = root / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        volume = volumes.get(mount["name"], {})
        if "secret" in volume:
            source = volume["secret"]
            data = {k: base64.b64decode(v) for k, v in objects["Secret", source["secretName"]]["data"].items()}
        elif "configMap" in volume:
            source = volume["configMap"]
            data = {k: v.encode() for k, v in objects["ConfigMap", source["name"]]["data"].items()}
        else:  # emptyDir, a PersistentVolumeClaim, a StatefulSet's volumeClaimTemplate: empty here
            source, data = {}, {}
        items = source.get("items") or [{"key": key, "path": key} for key in data]
        for item in items:
            (local / item["path"]).write_bytes(data[item["key"]])
            (local / item["path"]).chmod(item.get("mode", source.get("defaultMode", 0o644)))
        mounts[mount["mountPath"]] = local
    return mounts


def local_paths(text: str, mounts: dict[str, Path]) -> str:
    """``text`` with each path under a mount rewritten to the mount's local directory."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        text = re.sub(re.escape(mount_path) + r"(?=/|$)", str(mounts[mount_path]), text)
    return text


def map_addresses(text: str, address: Callable[[str, int], str | None]) -> str:
    """``text`` with each `host:port` replaced by ``address(host, port)`` (None: kept as it is)."""
    return _ADDRESS.sub(lambda m: address(m.group(1), int(m.group(2))) or m.group(0), text)
