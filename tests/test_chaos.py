"""The chaos soak's short form: three seeded random faults (seed 7: a kill, a kill during a save,
which leaves node 0 alone, and the first killed node joining again) into one 3-node job through
the real harness CLI; the job must finish and pass every invariant (scripts/chaos.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, worker_env

SEED = 7


def test_a_short_chaos_soak_keeps_every_invariant(tmp_path):
    report_path = tmp_path / "chaos.json"
    done = subprocess.run(
        [sys.executable, "scripts/local_cluster.py", "--nodes", "3", "--state-mb", "4", "--chaos", "3", "--seed",
         str(SEED), "--steps", "300", "--timeout", "180", "--json", str(report_path)],
        cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=900, check=False)
    assert report_path.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    chaos = json.loads(report_path.read_text())["chaos"]
    assert [f["kind"] for f in chaos["faults"]] == ["kill", "kill-during-save", "join"], chaos
    for name, held in chaos["invariants"].items():
        assert held, (name, chaos["details"], chaos["faults"])
    assert set(chaos["invariants"]) >= {"final_model_matches_reference", "snapshots_verify", "no_stale_commit",
                                        "no_step_trained_twice"}
    assert chaos["ok"] and chaos["seed"] == SEED and done.returncode == 0
