"""`torchrevive run` against torchrun itself: same flags, same defaults, same LaunchConfig."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from torch.distributed import run as torchrun

from agent.config import ConfigError, JobConfig
from launcher.launch import build_launch
from launcher.torchrun_flags import (
    OWN_DESTS,
    SCRIPT_DESTS,
    TORCHRUN_FLAG_KEYS,
    build_run_parser,
    parse_run_args,
)


def torch_actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in torchrun.get_args_parser()._actions if a.dest != "help"}


@pytest.fixture(autouse=True)
def no_pet_env(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)


def test_every_torchrun_flag_maps_to_one_config_key():
    assert set(torch_actions()) - set(SCRIPT_DESTS) == set(TORCHRUN_FLAG_KEYS)
    assert len(set(TORCHRUN_FLAG_KEYS.values())) == len(TORCHRUN_FLAG_KEYS)


def test_every_torchrun_option_string_is_accepted():
    ours = {s for a in build_run_parser()._actions for s in a.option_strings}
    theirs = {s for a in torch_actions().values() for s in a.option_strings}
    assert theirs <= ours
    assert {a.dest for a in build_run_parser()._actions} - set(torch_actions()) - {"help"} == set(OWN_DESTS)


def test_config_defaults_are_torchrun_defaults():
    config = JobConfig()
    for dest, key in TORCHRUN_FLAG_KEYS.items():
        default = torch_actions()[dest].default
        ours = config.get(key)
        if dest == "rdzv_conf":
            assert (default, ours) == ("", {})
        elif dest == "nproc_per_node":
            assert str(ours) == default
        else:
            assert ours == default, dest


def torch_launch(argv):
    return torchrun.config_from_args(torchrun.get_args_parser().parse_args(argv))


def comparable(launch):
    config, cmd, args = launch
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "logs_specs"}
    specs = config.logs_specs
    logs = (type(specs), specs._redirects, specs._tee, specs._local_ranks_filter)
    return fields, logs, cmd, args


ARGVS = [
    ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400",
     "--rdzv-id", "job", "--max-restarts", "3", "train.py", "--lr", "1"],
    ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3", "--master-port", "1234", "-m", "pkg.mod"],
    ["--rdzv_backend=c10d", "--rdzv_endpoint=h:1", "--rdzv_conf=join_timeout=5,is_host=false",
     "--monitor_interval", "0.5", "--start_method", "fork", "-r", "3", "-t", "0:1", "--local_ranks_filter", "0",
     "--no-python", "--role", "trainer", "--signals-to-handle", "SIGTERM", "--shutdown-timeout", "5",
     "--virtual-local-rank", "--duplicate-stdout-filters", "a,b", "--event-log-handler", "console", "prog"],
]


@pytest.mark.parametrize("argv", ARGVS)
def test_launch_config_equals_torchruns(argv):
    assert comparable(build_launch(parse_run_args(argv))) == comparable(torch_launch(argv))


def test_pet_variables_mean_what_they_mean_to_torchrun(monkeypatch):
    monkeypatch.setenv("PET_NNODES", "1:3")
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "127.0.0.1:4000")
    monkeypatch.setenv("PET_MAX_RESTARTS", "4")
    argv = ["--nproc-per-node", "2", "train.py"]
    assert comparable(build_launch(parse_run_args(argv))) == comparable(torch_launch(argv))


def test_standalone_uses_a_local_c10d_store_like_torchrun():
    config, _, _ = build_launch(parse_run_args(["--standalone", "--nproc-per-node", "2", "train.py"]))
    assert (config.rdzv_backend, config.rdzv_endpoint, config.min_nodes, config.max_nodes) == ("c10d", "localhost:0", 1, 1)
    assert config.run_id not in ("", "none")


def test_an_unknown_rdzv_conf_key_from_the_command_line_is_ignored_with_a_warning_as_torchrun_does(tmp_path):
    argv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-conf",
            "join_timeout=5,join_timout=7", "train.py"]
    with pytest.warns(UserWarning, match=r"--rdzv-conf: unknown option 'join_timout' .*did you mean 'join_timeout'.*ignored"):
        config, _, _ = build_launch(parse_run_args(argv))
    assert "join_timeout" in config.rdzv_configs and "join_timout" not in config.rdzv_configs
    # A job file keeps its strict check: there the key is a mistake to fix, not a command line to run.
    job = tmp_path / "job.yaml"
    job.write_text("rendezvous: {backend: c10d, endpoint: '127.0.0.1:1', conf: {join_timout: 7}}\n")
    with pytest.raises(ConfigError, match=r"job.yaml: rendezvous.conf: unknown option 'join_timout'"):
        parse_run_args(["--config", str(job), "train.py"])
