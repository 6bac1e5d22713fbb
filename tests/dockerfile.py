"""A Dockerfile read as data: its instructions by build stage, and .dockerignore's rules, so the
tests can check the image's contract without a docker engine."""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, USER, ...
    args: str  # the rest of the instruction, continuation lines joined


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(path: Path) -> list[Stage]:
    """The stages of `path`, each with its instructions in order (comments dropped, lines ending
    in a backslash joined). Instructions before the first FROM (global ARGs) are not kept."""
    stages: list[Stage] = []
    logical = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                              if not line.lstrip().startswith("#")))
    for line in logical.splitlines():
        if not line.strip():
            continue
        keyword, _, args = line.strip().partition(" ")
        keyword, args = keyword.upper(), " ".join(args.split())
        if keyword == "FROM":
            base, _, name = args.partition(" AS ") if " AS " in args else args.partition(" as ")
            stages.append(Stage(base=base.strip(), name=name.strip() or None))
        elif stages:
            stages[-1].instructions.append(Instruction(keyword, args))
    return stages


def numeric_uid(stage: Stage) -> int:
    """The UID of the stage's last USER, which must be numeric (Kubernetes' runAsNonRoot checks
    the image's user only when it is a number)."""
    user = stage.all("USER")[-1].args
    if not re.fullmatch(r"\d+(:\d+)?", user):
        raise ValueError(f"USER {user}: name the user by UID (and GID), e.g. USER 10001:10001")
    return int(user.split(":")[0])


def exec_form(args: str) -> list[str] | None:
    """The argument list of an exec-form ENTRYPOINT/CMD (a JSON array), else None (shell form)."""
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) and all(isinstance(a, str) for a in value) else None


def dockerignored(path: str, rules: list[str]) -> bool:
    """Whether docker leaves `path` (relative to the context) out of the build context: the last
    rule matching the path or one of its parent directories decides, a leading `!` re-includes.
    fnmatch's `*` also crosses `/` where docker's does not: keep rules to `*`, names and `**/`."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(prefix, pattern) or fnmatch.fnmatchcase(prefix, pattern.removeprefix("**/"))
               for prefix in prefixes):
            ignored = not negate
    return ignored


def dockerignore_rules(path: Path) -> list[str]:
    """The rules of a .dockerignore file, comments and blank lines dropped."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
