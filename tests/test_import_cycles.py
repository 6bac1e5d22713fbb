"""The product's modules (agent, launcher) and the harness's (scripts/harness, with the command
lines beside it) import one another without a cycle: at module level (what runs when a module is
first imported; imports under TYPE_CHECKING and inside functions are left out), the import graph is
acyclic, so any module can be imported first. (A package's ``__init__`` runs before its modules:
that implicit step is no edge here.) And the scripts are command lines: none imports another."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO, parse_python

SCRIPTS = REPO / "scripts"
PACKAGES = {REPO: ("agent", "launcher"), SCRIPTS: ("harness",)}
"""Each import root and its packages (the scripts and the tests import the harness with scripts/ on
their path)."""


def module_name(path: Path) -> str:
    root = SCRIPTS if path.is_relative_to(SCRIPTS) else REPO
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the product and of the harness, and every script, by its import name."""
    found = {module_name(p): p for root, packages in PACKAGES.items() for package in packages
             for p in (root / package).rglob("*.py")}
    return {**found, **{module_name(p): p for p in SCRIPTS.glob("*.py")}}


def module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The product's modules that ``path`` imports when it is imported (``from x import y`` counts
    ``x.y`` where that is a module, else ``x``)."""
    tree = parse_python(path)
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in (getattr(node, "body", []), getattr(node, "orelse", []), getattr(node, "finalbody", []),
                              *[h.body for h in getattr(node, "handlers", [])]):
                    visit(block)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        found.add(f"{base}.{alias.name}")
                    elif base in modules:
                        found.add(base)
    visit(tree.body)
    return found


def test_the_modules_of_the_product_and_of_the_harness_import_one_another_without_a_cycle():
    paths = modules()
    graph = {name: module_level_imports(path, set(paths)) - {name} for name, path in paths.items()}
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the path, 2 done

    def walk(name: str, path: list[str]) -> None:
        state[name] = 1
        for imported in sorted(graph[name]):
            if state[imported] == 1:
                cycles.append(path[path.index(imported):] + [imported] if imported in path else [name, imported])
            elif state[imported] == 0:
                walk(imported, [*path, imported])
        state[name] = 2

    for name in sorted(graph):
        if state[name] == 0:
            walk(name, [name])
    assert len(graph) > 50 and not cycles, cycles


def test_no_script_imports_another():
    scripts = {p.stem for p in SCRIPTS.glob("*.py")}
    imported = {}
    for script in sorted(scripts):
        for node in ast.walk(parse_python(SCRIPTS / f"{script}.py")):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if found := {name.split(".")[0] for name in names} & (scripts - {script}):
                imported[script] = sorted(found)
    assert len(scripts) > 10 and not imported, f"scripts that import scripts (shared parts go in harness/): {imported}"
