"""The recovery timeouts: derived from one another where the job leaves them unset, checked for
their order where it sets them, shown by --print-config, and handed to the workers."""

from __future__ import annotations

import subprocess
import warnings

import pytest
import yaml
from conftest import TORCHREVIVE, worker_env

from agent.config import ConfigError, recovery_timeouts
from agent.timeouts import default_lease_ttl_s, etcd_outage_grace_s
from agent.worker import PROCESS_GROUP_TIMEOUT, WorkerContext
from launcher.torchrun_flags import parse_run_args

ELASTIC = ["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"]
ETCD = ["--nnodes", "1:4", "--rdzv-backend", "etcd3", "--rdzv-endpoint", "127.0.0.1:2379"]


def resolved(*argv: str):
    return parse_run_args([*argv, "train.py"]).config


def test_defaults_follow_torch_and_keep_their_order():
    config = resolved(*ETCD)
    timeouts = recovery_timeouts(config)
    assert (timeouts.detection_s, timeouts.join_timeout, timeouts.last_call_timeout) == (15, 600, 30)
    # A join waits for a commit at most half of what join_timeout leaves after the last call.
    assert (config.elastic.join_wait, config.elastic.process_group_timeout, timeouts.lease_ttl) == (285, 600, 60)
    assert timeouts.rule_breaks() == []


def test_unset_timeouts_are_derived_from_those_the_job_sets():
    # A short join timeout leaves a deferred join half of what remains after the last call.
    config = resolved(*ELASTIC, "--rdzv-conf", "join_timeout=50,last_call_timeout=10")
    assert config.elastic.join_wait == 20
    # Slow heartbeats: the collectives wait longer than the agent needs to find a hung peer.
    config = resolved(*ETCD, "--rdzv-conf", "keep_alive_interval=200", "--set", "elastic.stop_grace=10")
    assert config.elastic.process_group_timeout == 2 * (200 * 3 + 10)
    assert recovery_timeouts(config).lease_ttl == default_lease_ttl_s(200, 3) > etcd_outage_grace_s(200, 3)
    assert recovery_timeouts(config).rule_breaks() == []
    # What the job sets is kept as set.
    assert resolved(*ELASTIC, "--set", "elastic.join_wait=7").elastic.join_wait == 7


@pytest.mark.parametrize("job, keys", [
    ("elastic: {process_group_timeout: 10}", ("elastic.process_group_timeout", "keep_alive_interval")),
    ("elastic: {join_wait: 590}", ("elastic.join_wait", "join_timeout")),
    ("rendezvous: {conf: {join_timeout: 20, last_call_timeout: 30}}", ("join_timeout", "last_call_timeout")),
    ("rendezvous: {conf: {keep_alive_max_attempt: 1}}", ("keep_alive_max_attempt", "keep_alive_interval")),
    ("rendezvous: {backend: etcd3, endpoint: '127.0.0.1:2379', conf: {lease_ttl: 10}}", ("lease_ttl", "keep_alive_interval")),
])
def test_a_job_file_with_timeouts_in_the_wrong_order_stops_with_one_line_naming_both_keys(tmp_path, job, keys):
    path = tmp_path / "job.yaml"
    path.write_text(f"job: {{nnodes: '1:4'}}\n{job}\n")
    args = [] if "backend" in job else ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"]
    with pytest.raises(ConfigError) as caught:
        parse_run_args(["--config", str(path), *args, "train.py"])
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert all(key in message for key in keys), message
    assert any(word in message for word in ("raise", "lower", "use 2 or more")), message


def test_torchruns_own_keys_in_the_wrong_order_on_the_command_line_only_warn_as_torchrun_runs_them():
    with pytest.warns(UserWarning, match=r"--rdzv-conf: join_timeout 20 s must exceed last_call_timeout 30 s"):
        config = resolved(*ELASTIC, "--rdzv-conf", "join_timeout=20,last_call_timeout=30")
    assert config.rendezvous.conf["join_timeout"] == "20" and config.elastic.join_wait == 0
    # Our own keys keep their strict check wherever they come from.
    with pytest.raises(ConfigError, match=r"--rdzv-conf: lease_ttl 10 s must exceed"):
        resolved(*ETCD, "--rdzv-conf", "lease_ttl=10")
    # A job of a fixed size has no last call: torchrun's short join timeout is fine there.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "join_timeout=5")


def test_our_own_overrides_and_odd_heartbeat_counts_are_judged_as_they_should_be():
    # --set is torchrevive's own override, not a torchrun command line: strict.
    with pytest.raises(ConfigError, match=r"--set rendezvous.conf=.*join_timeout 20 s must exceed last_call_timeout"):
        resolved(*ELASTIC, "--set", "rendezvous.conf={join_timeout: 20, last_call_timeout: 30}")
    # torchrun runs a job that drops a node at its first late heartbeat; so do we, with a warning.
    with pytest.warns(UserWarning, match=r"keep_alive_max_attempt 1 drops a healthy node"):
        resolved(*ELASTIC, "--rdzv-conf", "keep_alive_max_attempt=1")
    # torch's etcd v1 backend has none of these timeouts: no chain, no rule.
    config = resolved("--nnodes", "1:4", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379",
                      "--rdzv-conf", "last_call_timeout=900")
    assert recovery_timeouts(config) is None


def test_print_config_shows_the_chain_as_comments_of_a_loadable_document():
    done = subprocess.run([*TORCHREVIVE, "run", "--print-config", *ETCD, "--rdzv-conf", "keep_alive_interval=2",
                           "train.py"], env=worker_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    document = yaml.safe_load(done.stdout)
    assert document["elastic"]["process_group_timeout"] == 600
    chain = [line for line in done.stdout.splitlines() if line.startswith("#   ")]
    keys = [line.split()[1] for line in chain]
    assert keys == ["rendezvous.conf.keep_alive_interval", "rendezvous.conf.heartbeat_timeout", "elastic.stop_grace",
                    "elastic.in_process_deadline", "rendezvous.conf.last_call_timeout", "elastic.join_wait",
                    "rendezvous.conf.join_timeout", "elastic.process_group_timeout", "rendezvous.conf.lease_ttl"]
    assert chain[0].split()[4] == "6"  # 2 s x 3 heartbeats


SHOW_TIMEOUT = """
import torch, torch.distributed as dist
import agent

def train(round):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    print("timeouts", agent.WorkerContext.from_env().process_group_timeout.total_seconds(),
          backend.options._timeout.total_seconds(), flush=True)

agent.run_resilient(train)
"""


def test_workers_get_the_process_group_timeout_and_run_resilient_uses_it(tmp_path):
    script = tmp_path / "show_timeout.py"
    script.write_text(SHOW_TIMEOUT)
    done = subprocess.run([*TORCHREVIVE, "run", "--standalone", "--nproc-per-node", "1", "--set",
                           "elastic.process_group_timeout=77", str(script)],
                          env=worker_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "timeouts 77.0 77.0" in done.stdout, done.stdout[-2000:]


def test_worker_context_reads_the_timeout_and_names_a_bad_value():
    assert WorkerContext.from_env({PROCESS_GROUP_TIMEOUT: "12.5"}).process_group_timeout.total_seconds() == 12.5
    assert WorkerContext.from_env({}).process_group_timeout is None
    with pytest.raises(ValueError, match=f"{PROCESS_GROUP_TIMEOUT}='soon' is not a number of seconds"):
        WorkerContext.from_env({PROCESS_GROUP_TIMEOUT: "soon"})
