"""Every private name of torch that the package uses goes through agent/torch_private.py, which
checks the torch version; the declared torch requirement is the one torch that is tested."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import torch

from conftest import REPO, parse_python

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
        tree = parse_python(path)
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


SUBCLASSES = {  # module of the package -> (its subclasses of torch's classes, their torch base)
    "agent/recovery_agent.py": ("RecoveryAgent",),
    "agent/rendezvous/prompt.py": ("PromptOpExecutor",),
    "agent/warm_workers.py": ("SpawnedSubprocessHandler", "WarmSubprocessHandler"),
}


def torch_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def torch_source(cls: type) -> str:
    """The source of the methods that ``cls`` and its torch bases define. Read function by function:
    ``inspect.getsource`` of a class parses its whole module with ``ast`` on Python 3.11, whose
    AST conversion keeps its recursion depth per interpreter, not per thread, and fails with
    "AST constructor recursion depth mismatch" while another thread of the process parses too."""
    functions = [inspect.unwrap(value.fget if isinstance(value, property) else getattr(value, "__func__", value))
                 for klass in cls.__mro__ if klass.__module__.startswith("torch.")
                 for value in vars(klass).values()]
    return "".join(inspect.getsource(f) for f in functions if inspect.isfunction(f))


def test_torchs_private_methods_have_the_signatures_the_package_was_written_against():
    from agent.torch_private import PRIVATE_METHODS

    differ = {f"{path}.{name}": (str(inspect.signature(getattr(torch_class(path), name))), recorded)
              for path, methods in PRIVATE_METHODS.items() for name, recorded in methods.items()
              if str(inspect.signature(getattr(torch_class(path), name))) != recorded}
    assert not differ, differ


def test_every_private_method_overridden_or_attribute_used_by_a_subclass_is_listed():
    """Computed from the code: each private method a subclass defines that its torch base has, and
    each ``self._name`` a subclass's module uses that torch's base class uses too."""
    from agent.torch_private import PRIVATE_ATTRIBUTES, PRIVATE_METHODS

    listed_methods = {name for methods in PRIVATE_METHODS.values() for name in methods}
    listed_attributes = {name for names in PRIVATE_ATTRIBUTES.values() for name in names}
    bases = {path: torch_class(path) for path in PRIVATE_METHODS}
    unlisted = []
    for module_path, class_names in SUBCLASSES.items():
        module = importlib.import_module(module_path[:-3].replace("/", "."))
        for class_name in class_names:
            cls = getattr(module, class_name)
            base = next(b for b in bases.values() if issubclass(cls, b))
            base_source = torch_source(base)
            for name, value in vars(cls).items():
                if name.startswith("_") and not name.startswith("__") and callable(value) and hasattr(base, name) \
                        and name not in listed_methods:
                    unlisted.append(f"{class_name}.{name} (method)")
            used = set(re.findall(r"self\.(_[a-z][a-z0-9_]*)", (REPO / module_path).read_text()))
            unlisted += [f"{class_name}: self.{name}" for name in sorted(used - listed_attributes - listed_methods)
                         if re.search(rf"self\.{name}\b", base_source)]
    assert not unlisted, unlisted
    # And each listed attribute is still torch's.
    for path, names in PRIVATE_ATTRIBUTES.items():
        source = torch_source(torch_class(path))
        assert all(re.search(rf"self\.{name}\b", source) for name in names), (path, names)
