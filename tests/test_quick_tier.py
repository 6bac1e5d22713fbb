"""`scripts/test.sh --quick` leaves out exactly the tests that tests/conftest.py's SLOW names, each
of which still exists, and keeps every other test."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, SLOW


def collect(command: list[str]) -> subprocess.Popen:
    """Start collecting (only) with ``command``, a pytest with ``-q`` (its stdout: one test id a line)."""
    env = {**os.environ, "TORCHREVIVE_VENV": sys.prefix}
    return subprocess.Popen([*command, "--collect-only"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def collected_ids(proc: subprocess.Popen) -> set[str]:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    return {line for line in output.splitlines() if "::" in line}


def slow_entry(test_id: str) -> str | None:
    """The entry of SLOW that names ``test_id`` ("tests/test_x.py::test_f[param]"), if any."""
    path, function = test_id.split("::", 1)
    module = path.rsplit("/", 1)[-1]
    for entry in (module, f"{module}::{function.split('[', 1)[0]}"):
        if entry in SLOW:
            return entry
    return None


def test_the_quick_tier_leaves_out_the_slow_tests_and_keeps_the_rest():
    collecting_all = collect([sys.executable, "-m", "pytest", "-q"])  # both at once: a collection takes seconds
    quick = collected_ids(collect(["bash", "scripts/test.sh", "--quick"]))  # test.sh passes -q itself
    everything = collected_ids(collecting_all)
    named = {slow_entry(test_id) for test_id in everything}
    assert SLOW <= named, f"SLOW names no collected test: {sorted(SLOW - named)}"
    assert quick == {test_id for test_id in everything if slow_entry(test_id) is None}
