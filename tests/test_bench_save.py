"""The save benchmark's short form: every method runs, and the JSON keeps its contract. Speed is
measured by the script itself (scripts/bench_save.py), never here."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import bench_save
import pytest
from conftest import REPO, worker_env

METHODS = {"torchrevive", "torchrevive_buffered", "torchrevive_idle", "torchrevive_nice19", "torchrevive_io1",
           "torchrevive_slabs128", "torchsnapshot_take", "torchsnapshot_async_take", "dcp_save", "dcp_async_save"}


def test_bench_save_writes_its_contract(tmp_path):
    out = tmp_path / "save.json"
    done = subprocess.run([sys.executable, "scripts/bench_save.py", "--size-gb", "0.2", "--repeats", "1", "--saves", "1",
                           "--slowdown-window-s", "1", "--dir", str(tmp_path), "--json", str(out)],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["size_bytes"] > 0.1e9 and set(report["results"]) == METHODS
    for method, result in report["results"].items():
        assert 0 < result["blocking_s"] <= result["done_s"] <= result["durable_s"], (method, result)
        assert result["first_blocking_s"] > 0 and result["quiet_step_s"] > 0
    # Training steps ran while torchrevive's staged saves were written, and were timed.
    assert report["slowdown_window_s"] == 1
    ours = report["results"]["torchrevive"]
    assert ours["slowdown"] > 0, ours
    for blocking in ("torchsnapshot_take", "dcp_save"):  # nothing is written after they return
        assert report["results"][blocking]["slowdown"] is None
    assert report["results"]["torchrevive"]["fsyncs"] is True
    assert report["torchrevive_blocking_s_per_gb"] > 0


def test_a_method_whose_process_fails_is_reported_with_its_error(tmp_path):
    """One method failing (say, a peer's bug in the torch at hand) leaves the others measured."""
    args = argparse.Namespace(size_gb=0.01, saves=1, device="cpu", slowdown_window_s=1.0)
    with pytest.raises(bench_save.MethodFailed, match="unknown method 'no_such_method'"):
        bench_save.run_child(args, "no_such_method", tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_unknown_methods_are_refused_by_name():
    done = subprocess.run([sys.executable, "scripts/bench_save.py", "--methods", "torchrevive,dcp_sav"],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--methods: unknown dcp_sav" in done.stderr, done.stderr
