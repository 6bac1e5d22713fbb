"""The short form of scripts/loss_sensitivity.py: a tiny MLP trained twice side by side. With no
difference injected the two runs' losses are equal at every step (so any difference the script
reports comes from the one it injects); with one, they differ after it."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, worker_env


def sensitivity(tmp_path, rel: float) -> dict:
    out = tmp_path / f"sensitivity_{rel}.json"
    done = subprocess.run([sys.executable, "scripts/loss_sensitivity.py", "--width", "64", "--steps", "30",
                           "--perturb-at", "10", "--rel", str(rel), "--json", str(out)],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_two_runs_match_exactly_until_a_difference_is_injected(tmp_path):
    same = sensitivity(tmp_path, 0.0)
    assert [step for step, _ in same["differences"]] == list(range(11, 31))
    assert same["max_relative_difference"] == 0.0
    perturbed = sensitivity(tmp_path, 1e-2)
    assert perturbed["max_relative_difference"] > 0.0
