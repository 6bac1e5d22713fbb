"""Every private name of torch that the package uses goes through agent/torch_private.py, which
checks the torch version; the declared torch requirement is the one torch that is tested."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

from conftest import REPO

ALLOWED_PRIVATE_MODULES = {"torch.distributed._shard.sharded_tensor"}
"""ShardedTensor's documented home (its class is public; torch has no other path to it)."""
TORCH_OBJECTS = re.compile(r"(handler|holder|agent|registry|settings|spec|executor)$")
"""Names the package gives torch's rendezvous and agent objects."""


def sources() -> list[Path]:
    return [p for package in ("agent", "launcher") for p in (REPO / package).rglob("*.py")
            if p.name != "torch_private.py"]


def test_no_module_but_torch_private_names_a_private_torch_part():
    found = []
    for path in sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                module = node.module or ""
                private_module = any(part.startswith("_") for part in module.split(".")) and module not in ALLOWED_PRIVATE_MODULES
                private_names = [a.name for a in node.names if a.name.startswith("_")]
                if private_module or private_names:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} from {module} import {private_names or '...'}")
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and TORCH_OBJECTS.search(node.value.id)
                    and node.value.id not in ("self", "cls")):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, found


def test_the_declared_torch_is_the_tested_one():
    from agent import torch_private

    pyproject = (REPO / "pyproject.toml").read_text()
    major, minor = torch_private.READ_IN
    assert f'"torch>={major}.{minor},<{major}.{minor + 1}"' in pyproject
    assert torch.__version__.startswith(f"{major}.{minor}.")
