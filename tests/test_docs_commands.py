"""The documentation stays true: every command shown in README.md and docs/*.md runs, and every
relative link and #anchor in them resolves.

Commands are taken from fenced ``bash``/``sh``/``shell``/``console`` blocks and checked without
doing their work:

- ``torchrevive run ... script.py args``: run with ``--print-config`` inserted after ``run`` (the
  whole config is resolved, nothing is launched); the training script must exist and know every
  ``--flag`` given to it (its ``--help``);
- ``torchrevive COMMAND ...``: ``torchrevive COMMAND --help`` must know every ``--flag`` shown;
- ``python scripts/X.py ...`` (or ``.venv/bin/python``): ``scripts/X.py --help`` must know every
  ``--flag`` shown;
- ``bash X.sh ...``: these set up environments or run long jobs, so the file must exist and parse
  (``bash -n``);
- anything else must be named in ``NOT_RUN`` with the reason, or the test fails.

Every path-like argument under the repository's own folders (``examples/``, ``configs/``, ...)
must exist. Each distinct command is checked once; the Python-level runs share one interpreter
(torch is imported once), and whatever that batch could not finish runs in a process of its own.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TORCHREVIVE = [sys.executable, "-m", "launcher.cli"]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# Commands shown in the docs that this test does not run, by their first word, with the reason.
NOT_RUN = {
    "kubectl": "needs a Kubernetes cluster",
    "docker": "needs a docker engine",
    "torchrun": "torch's own launcher (the etcd3 handler it finds is tested in tests/test_etcd3.py)",
}
# Arguments starting with one of these are paths in the repository and must exist.
REPO_DIRS = ("examples/", "configs/", "scripts/", "docs/", "tests/", "agent/", "launcher/")
TIMEOUT_S = 120


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of each fenced code block."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if lang is None and stripped.startswith("```"):
            lang, start, body = stripped[3:].strip().lower(), number + 1, []
        elif lang is not None and stripped.startswith("```"):
            blocks.append((lang, start, body))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def shell_commands(path: Path) -> list[Command]:
    commands = []
    doc = str(path.relative_to(REPO))
    for lang, start, lines in fenced_blocks(path.read_text()):
        if lang not in SHELL_LANGS:
            continue
        pending, first = "", 0
        for offset, line in enumerate(lines):
            if lang == "console":
                if not (line.startswith("$ ") or pending):
                    continue  # output, not a command
                line = line[2:] if line.startswith("$ ") else line
            if not pending:
                first = start + offset
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            text = (pending + line).strip()
            pending = ""
            if text and shlex.split(text, comments=True):
                commands.append(Command(doc, first, text))
    return commands


def documented_commands() -> list[Command]:
    return [command for path in DOCS for command in shell_commands(path)]


def without_env(argv: list[str]) -> list[str]:
    """The command after any leading VAR=value assignments."""
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        argv = argv[1:]
    return argv


def kind(argv: list[str]) -> str:
    argv = without_env(argv)
    if not argv:
        return "empty"
    if argv[0] == "torchrevive":
        return "torchrevive"
    if Path(argv[0]).name.startswith("python") and len(argv) > 1 and argv[1].endswith(".py"):
        return "python_script"
    if argv[0] == "bash" and len(argv) > 1:
        return "bash_script"
    if argv[0] in NOT_RUN:
        return "not_run"
    return "unknown"


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


# An invocation is ("torchrevive", *args), ("python", path, *args) or ("bash", *args).
_RESULTS: dict[tuple[str, ...], Result] = {}
_PLAN: list[tuple[str, ...]] | None = None  # while planning, invocations are recorded, not run


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")


def invoke(invocation: tuple[str, ...]) -> Result:
    """The invocation's result: from the batched run when there was one, else run now."""
    if _PLAN is not None:
        _PLAN.append(invocation)
        return Result(0, "", "")
    if invocation not in _RESULTS:
        head, *args = invocation
        argv = {"torchrevive": TORCHREVIVE, "python": [sys.executable], "bash": ["bash"]}[head] + args
        done = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
        _RESULTS[invocation] = Result(done.returncode, done.stdout, done.stderr)
    return _RESULTS[invocation]


# Runs many Python-level invocations in one interpreter, so that torch is imported once: each is
# run as `python -m launcher.cli ...` or `python script.py ...` would run it, its output captured.
# Scripts that end with os._exit (no destructors) end their run only: its code is the exit code.
_BATCH = r"""
import contextlib, io, json, os, runpy, sys
exits = []
def _exit(code):
    exits.append(code)
    raise SystemExit(code)
os._exit = _exit
for line in sys.stdin:
    head, *args = json.loads(line)
    out, err, code = io.StringIO(), io.StringIO(), 0
    exits.clear()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if head == "torchrevive":
                sys.argv = ["torchrevive", *args]
                runpy.run_module("launcher.cli", run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(args)
                sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
                runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        if isinstance(exit.code, str):
            err.write(exit.code)
    except BaseException as error:
        code = 1
        err.write(f"{type(error).__name__}: {error}")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    code = exits[0] if exits else code
    sys.__stdout__.write("@@result@@ " + json.dumps([code, out.getvalue(), err.getvalue()]) + "\n")
    sys.__stdout__.flush()
"""


def run_batch(invocations: list[tuple[str, ...]]) -> None:
    """Fills _RESULTS for as many invocations as the batch finished; invoke() runs the others."""
    lines = "".join(json.dumps(list(invocation)) + "\n" for invocation in invocations)
    try:
        done = subprocess.run([sys.executable, "-c", _BATCH], input=lines, cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return
    results = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines()
               if line.startswith("@@result@@ ")]
    for invocation, (code, out, err) in zip(invocations, results):
        _RESULTS[invocation] = Result(code, out, err)


def help_text(invocation: tuple[str, ...]) -> str:
    """The --help output of an invocation, or an AssertionError when it fails."""
    result = invoke((*invocation, "--help"))
    assert result.returncode == 0, \
        f"{' '.join(invocation)} --help exited {result.returncode}: {result.stderr[-2000:]}"
    return result.stdout


def flags(args: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in args if re.fullmatch(r"--[A-Za-z][\w-]*(=.*)?", arg)]


def unknown_flags(args: list[str], help_output: str) -> list[str]:
    return [flag for flag in flags(args)
            if flag != "--help" and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_output)]


def missing_paths(args: list[str]) -> list[str]:
    return [arg for arg in args if arg.startswith(REPO_DIRS) and not (REPO / arg).exists()]


def training_script(args: list[str]) -> int | None:
    """Index of the training script in `torchrevive run`'s arguments (the first *.py)."""
    return next((i for i, arg in enumerate(args) if arg.endswith(".py") and not arg.startswith("-")), None)


def check(command: Command) -> str | None:
    """None when the command is fine, else what is wrong with it."""
    argv = without_env(command.argv)
    problems = [f"no such file: {path}" for path in missing_paths(argv)]
    what = kind(command.argv)
    if what == "torchrevive":
        sub = argv[1] if len(argv) > 1 else "--help"
        if sub == "run" and "--help" not in argv and "-h" not in argv:
            result = invoke(("torchrevive", "run", "--print-config", *argv[2:]))
            if result.returncode != 0:
                problems.append(f"--print-config exited {result.returncode}: {result.stderr.strip()[-2000:]}")
            script = training_script(argv)
            if script is not None:
                path = REPO / argv[script]
                if not path.is_file():
                    problems.append(f"no such file: {argv[script]}")
                elif argv[script + 1:]:
                    wrong = unknown_flags(argv[script + 1:], help_text(("python", argv[script])))
                    problems += [f"{argv[script]} has no flag {flag}" for flag in wrong]
        elif sub.startswith("-"):
            result = invoke(("torchrevive", *argv[1:]))
            if result.returncode != 0:
                problems.append(f"exited {result.returncode}: {result.stderr.strip()[-2000:]}")
        else:
            wrong = unknown_flags(argv[2:], help_text(("torchrevive", sub)))
            problems += [f"torchrevive {sub} has no flag {flag}" for flag in wrong]
    elif what == "python_script":
        path = REPO / argv[1]
        if not path.is_file():
            problems.append(f"no such file: {argv[1]}")
        else:
            wrong = unknown_flags(argv[2:], help_text(("python", argv[1])))
            problems += [f"{argv[1]} has no flag {flag}" for flag in wrong]
    elif what == "bash_script":
        path = REPO / argv[1]
        if not path.is_file():
            problems.append(f"no such file: {argv[1]}")
        else:
            result = invoke(("bash", "-n", argv[1]))
            if result.returncode != 0:
                problems.append(f"bash -n {argv[1]}: {result.stderr.strip()}")
    elif what == "unknown":
        problems.append(f"{argv[0]!r} is neither checked here nor named in NOT_RUN")
    return "; ".join(dict.fromkeys(problems)) or None


COMMANDS = documented_commands()


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str | None]:
    """Every distinct command checked once. The invocations the checks need are planned first
    and run in one batch (torch imported once), so the test stays fast; bash -n runs apart."""
    global _PLAN
    distinct = {command.text: command for command in COMMANDS if kind(command.argv) != "not_run"}
    _PLAN = []
    try:
        for command in distinct.values():
            check(command)
        planned = list(dict.fromkeys(_PLAN))
    finally:
        _PLAN = None
    run_batch([invocation for invocation in planned if invocation[0] != "bash"])
    return {text: _safe_check(command) for text, command in distinct.items()}


def _safe_check(command: Command) -> str | None:
    try:
        return check(command)
    except (AssertionError, subprocess.TimeoutExpired) as error:
        return str(error)


def test_the_docs_show_commands_of_each_kind():
    kinds = {kind(command.argv) for command in COMMANDS}
    assert {"torchrevive", "python_script", "bash_script"} <= kinds, kinds


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: f"{command.doc}:{command.line}")
def test_documented_command_runs(command: Command, outcomes: dict[str, str | None]):
    if kind(command.argv) == "not_run":
        pytest.skip(f"not run: {NOT_RUN[without_env(command.argv)[0]]}")
    problem = outcomes[command.text]
    assert problem is None, f"{command}\n{problem}"


def test_readme_keeps_exactly_the_two_commands():
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Two commands\n", 1)[1].split("\n## ", 1)[0]
    blocks = fenced_blocks(section)
    assert len(blocks) == 1, "the section shows one block of commands"
    commands = [argv for argv in map(lambda line: shlex.split(line, comments=True), blocks[0][2]) if argv]
    assert commands == [["bash", "scripts/demo.sh"], ["bash", "scripts/test.sh"]], commands


# Links -------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def outside_fences(path: Path) -> list[str]:
    """The file's lines, those of fenced code blocks blanked (line numbers kept)."""
    lines, inside = [], False
    for line in path.read_text().splitlines():
        if line.strip().startswith("```"):
            inside = not inside
            lines.append("")
        else:
            lines.append("" if inside else line)
    return lines


def prose(path: Path) -> list[str]:
    """outside_fences without inline code spans: a link shown in code is not a link."""
    return [re.sub(r"`[^`]*`", "``", line) for line in outside_fences(path)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in outside_fences(path):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return frozenset(result)


def links() -> list[tuple[Path, int, str]]:
    found = []
    for path in DOCS:
        for number, line in enumerate(prose(path), 1):
            found += [(path, number, target) for target in LINK.findall(line)]
    return found


def test_the_docs_have_links():
    assert len(links()) > 20


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for path, number, target in links():
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}:{number}: {target}"
        if not destination.exists():
            broken.append(f"{where}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{where}: no heading with anchor #{anchor}")
        elif REPO not in destination.parents and destination != REPO:
            broken.append(f"{where}: outside the repository")
    assert not broken, "\n".join(broken)


def test_slug_matches_github():
    assert slug("Beside torchft and ft_launcher: one kill") == "beside-torchft-and-ft_launcher-one-kill"
    assert slug("In-process beside the memory tier and torchft, 2026-12-04 23:02") == \
        "in-process-beside-the-memory-tier-and-torchft-2026-12-04-2302"
    assert slug("Dependencies, and why") == "dependencies-and-why"
    assert slug("The memory tier's data plane") == "the-memory-tiers-data-plane"
