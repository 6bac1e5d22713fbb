"""The data-plane benchmark's short form: both MACs run through the real server and client, and
the JSON keeps its contract. Speed is measured by the script itself
(scripts/bench_peer_files.py), never here."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, worker_env


def test_bench_peer_files_writes_its_contract(tmp_path):
    out = tmp_path / "peer.json"
    done = subprocess.run([sys.executable, "scripts/bench_peer_files.py", "--size-mb", "8", "--rounds", "2",
                           "--dir", str(tmp_path), "--json", str(out)],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["size_bytes"] == 8 << 20 and set(report["results"]) == {"blake3", "hmac_sha256"}
    for mac, result in report["results"].items():
        assert result["hash_gbps"] > 0 and result["pull_gbps"] > 0 and result["pull_parallel_gbps"] > 0, mac
        assert len(result["pull_s"]) == len(result["pull_parallel_s"]) == 2
