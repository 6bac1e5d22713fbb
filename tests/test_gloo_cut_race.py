"""The short form of scripts/gloo_cut_race.py: two-rank trials of each way of cutting a round's
connections run, and the JSON keeps its contract. How often each hangs under load is measured by
the script itself (docs/measurements.md), never here."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, worker_env


def test_gloo_cut_race_writes_its_contract(tmp_path):
    out = tmp_path / "race.json"
    done = subprocess.run([sys.executable, "scripts/gloo_cut_race.py", "--trials", "1", "--busy", "0",
                           "--json", str(out)], cwd=REPO, env=worker_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"both_at_once", "reading_first"}
    assert all(result["trials"] == 1 for result in report["results"].values())
    assert report["results"]["reading_first"]["hung"] == 0  # the cut the product makes frees the collective
