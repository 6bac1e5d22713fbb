"""End to end through the real `torchrevive run`: real agents, real c10d rendezvous on
127.0.0.1, real workers training examples/train.py over gloo."""

from __future__ import annotations

import re
import subprocess
import uuid

import pytest
import yaml
from conftest import REPO, TORCHREVIVE, start_torchrevive
from torch.distributed import run as torchrun

pytestmark = pytest.mark.e2e
TIMEOUT_S = 180


def run_nodes(nodes: int, args: list[str]) -> list[tuple[int, str]]:
    procs = [start_torchrevive(["run", *args]) for _ in range(nodes)]
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append((proc.returncode, out))
    return results


def steps_logged(output: str) -> list[tuple[int, int]]:
    return [(int(s), int(w)) for s, w in re.findall(r"step=(\d+) loss=\S+ world_size=(\d+)", output)]


def elastic_args(endpoint: str, *extra: str) -> list[str]:
    return [
        "--nnodes", "2:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-id", f"e2e-{uuid.uuid4().hex[:8]}", "--rdzv-conf", "join_timeout=60,last_call_timeout=1", "--monitor-interval", "0.2",
        *extra,
    ]


def test_two_agents_train_at_world_size_two(rdzv_endpoint):
    results = run_nodes(2, [*elastic_args(rdzv_endpoint), "examples/train.py", "--steps", "4"])
    assert [code for code, _ in results] == [0, 0], results
    logged = steps_logged("".join(out for _, out in results))
    assert logged == [(1, 2), (2, 2), (3, 2), (4, 2)]


def test_crashed_worker_is_restarted_by_its_agent():
    # One agent, two workers: the agent restarts its whole worker group after rank 0 fails.
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--monitor-interval", "0.2",
            "examples/train.py", "--steps", "4", "--crash-at-step", "2"]
    [(code, output)] = run_nodes(1, args)
    assert code == 0, output
    assert "injected failure at step 2 (--crash-at-step)" in output
    assert "world_size=2 restart=0" in output and "world_size=2 restart=1" in output
    assert steps_logged(output)[-1] == (4, 2)


def test_two_nodes_resume_after_a_worker_crash(rdzv_endpoint):
    # Each round's workers get a fresh store: stale peer addresses from the failed round would
    # make the new round's gloo init fail or hang.
    args = [*elastic_args(rdzv_endpoint, "--max-restarts", "2"), "examples/train.py", "--steps", "4", "--crash-at-step", "2"]
    results = run_nodes(2, args)
    assert [code for code, _ in results] == [0, 0], results
    output = "".join(out for _, out in results)
    assert "injected failure at step 2 (--crash-at-step)" in output
    assert len(re.findall(r"world_size=2 restart=\d", output)) == 2  # workers started twice
    assert steps_logged(output)[-1] == (4, 2)


def test_exhausted_restarts_exit_nonzero_with_torchruns_summary(rdzv_endpoint):
    args = ["--standalone", "--nproc-per-node", "1", "--max-restarts", "0", "examples/train.py", "--steps", "3", "--crash-at-step", "1"]
    [(code, output)] = run_nodes(1, args)
    assert code == 1
    assert "examples/train.py FAILED" in output
    assert "Root Cause (first observed failure)" in output
    assert "injected failure at step 1" in output


def test_example_config_trains_at_world_size_two_and_resumes(rdzv_endpoint, tmp_path):
    args = ["--config", "configs/local.yaml", "--rdzv-endpoint", rdzv_endpoint, "--set", f"checkpoint.dir={tmp_path}",
            "--set", "checkpoint.interval_steps=2", "examples/train.py", "--fsdp", "--steps"]
    [(code, output)] = run_nodes(1, [*args, "3"])
    assert code == 0, output
    assert "mode=fsdp2" in output
    assert steps_logged(output) == [(1, 2), (2, 2), (3, 2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]
    # A second run resumes from the committed snapshot of step 2, with the same losses.
    [(code, resumed)] = run_nodes(1, [*args, "3"])
    assert code == 0, resumed
    assert "resumed from step 2" in resumed
    assert re.findall(r"step=3 loss=\S+", resumed) == re.findall(r"step=3 loss=\S+", output)


def test_help_lists_every_torchrun_flag():
    out = subprocess.run([*TORCHREVIVE, "run", "--help"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    for action in torchrun.get_args_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--") and "_" not in option:
                assert option in out


def test_print_config_shows_the_resolved_job():
    proc = start_torchrevive(["run", "--config", "configs/local.yaml", "--max-restarts", "9", "--print-config"])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    resolved = yaml.safe_load(out)
    assert resolved["job"]["max_restarts"] == 9
    assert resolved["rendezvous"]["backend"] == "c10d"


def test_bad_config_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("job:\n  nnodes: '3:1'\n")
    proc = start_torchrevive(["run", "--config", str(bad), "examples/train.py"])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out.strip() == f"torchrevive run: error: {bad}: job.nnodes: '3:1' has min 3 > max 1; write MIN:MAX with MIN <= MAX"
