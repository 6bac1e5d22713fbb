"""The job config: YAML loading, typing, validation errors, and override precedence."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from agent.config import (
    ConfigError,
    JobConfig,
    load_config,
    parse_seconds,
    rdzv_conf_for_torch,
    validate,
)
from launcher.cli import main as torchrevive_main
from launcher.torchrun_flags import parse_run_args

CONFIGS = Path(__file__).parents[1] / "configs"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def resolve(tmp_path: Path, yaml_text: str, *flags: str):
    return parse_run_args(["--config", write(tmp_path, yaml_text), *flags, "train.py"])


def test_example_config_loads_and_validates():
    config = load_config(Path(__file__).parents[1] / "configs" / "local.yaml")
    validate(config, {})
    assert config.rendezvous.backend == "c10d"
    assert config.min_max_nodes == (1, 2)
    assert config.rendezvous.conf["last_call_timeout"] == "1s"
    assert rdzv_conf_for_torch(config.rendezvous.conf)["last_call_timeout"] == 1


def test_round_trip_through_print_config_yaml(tmp_path):
    config = resolve(tmp_path, "job: {nnodes: '2:4', max_restarts: 5}\ncheckpoint: {keep: 7}").config
    again = load_config(write(tmp_path, config.to_yaml()))
    assert again == config


def test_the_etcd_password_is_redacted_and_password_file_accepted(tmp_path):
    request = resolve(tmp_path, "rendezvous:\n  backend: etcd3\n  endpoint: 127.0.0.1:2379\n  conf:\n"
                                "    user: root\n    password: hunter2\n    password_file: /run/secrets/etcd\n")
    text = request.config.to_yaml()
    assert "hunter2" not in text and request.config.rendezvous.conf["password"] == "hunter2"
    assert load_config(write(tmp_path, text)).rendezvous.conf == {
        "user": "root", "password": "<redacted>", "password_file": "/run/secrets/etcd"}


def test_a_password_flag_warns_that_ps_shows_it(tmp_path):
    with pytest.warns(UserWarning, match="--rdzv-conf: a password on the command line is visible"):
        parse_run_args(["--rdzv-backend", "etcd3", "--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-conf",
                        "user=root,password=hunter2", "train.py"])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("checkpoint:\n  kep: 3\n", r"job.yaml: checkpoint.kep: unknown key \(did you mean 'checkpoint.keep'\?\)"),
        ("chekpoint:\n  keep: 3\n", r"unknown section 'chekpoint' \(did you mean 'checkpoint'\?\)"),
        ("job:\n  keep: 3\n", r"job.keep: unknown key \(did you mean 'checkpoint.keep'\?\)"),
        ("checkpoint:\n  keep: three\n", r"job.yaml: checkpoint.keep: 'three' is not a whole number"),
        ("job:\n  max_restarts: true\n", r"job.max_restarts: True is not a whole number"),
        ("checkpoint:\n  verify: always\n", r"checkpoint.verify: 'always' is not one of off, sample, full"),
        ("job:\n  monitor_interval: soon\n", r"job.monitor_interval: 'soon' is not a duration"),
        ("job:\n  nnodes: 1.5\n", r"job.nnodes: 1.5 is not a whole number or 1.5 is not a string$"),
        ("launch:\n  preload: [torch, 3]\n", r"launch.preload: \['torch', 3\] is not a list of strings$"),
        ("rendezvous:\n  conf: [1]\n", r"rendezvous.conf: \[1\] is not a mapping of key: value$"),
        ("restore:\n  prefetch: 'yes'\n", r"restore.prefetch: 'yes' is not true or false$"),
        ("[1, 2]\n", r"top level must be a mapping"),
        ("job: [1]\n", r"section 'job' must be a mapping"),
        ("job: {nnodes: '1:2'\n", r"not valid YAML"),
    ],
)
def test_bad_yaml_gets_one_clear_error(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("job: {nnodes: '4:2'}", r"job.yaml: job.nnodes: '4:2' has min 4 > max 2"),
        ("job: {nnodes: '0:2'}", r"job.nnodes: '0:2' has a minimum of 0"),
        ("job: {nnodes: 'two'}", r"job.nnodes: 'two' is not N or MIN:MAX"),
        ("job: {max_restarts: -1}", r"job.yaml: job.max_restarts: -1 is negative"),
        ("job: {nproc_per_node: 'many'}", r"job.nproc_per_node: 'many' must be a whole number >= 1 or one of auto"),
        ("rendezvous: {backend: c10d, endpoint: 'localhost:99999'}", r"rendezvous.endpoint: 'localhost:99999' has port 99999"),
        ("rendezvous: {backend: c10d, endpoint: 'local host:1'}", r"rendezvous.endpoint: 'local host:1' is not host:port"),
        ("rendezvous: {backend: etcd3}", r"rendezvous.endpoint: backend 'etcd3' needs an endpoint"),
        ("rendezvous: {backend: c10d, conf: {join_timout: 5}}", r"unknown option 'join_timout' .*did you mean 'join_timeout'"),
        ("rendezvous: {backend: c10d, conf: {join_timeout: 'ten'}}", r"join_timeout: 'ten' is not a duration"),
        ("rendezvous: {backend: c10d, conf: {join_timeout: 1500ms}}", r"join_timeout: 1500ms is not whole seconds"),
        ("checkpoint: {keep: 0}", r"checkpoint.keep: 0 must be >= 1"),
        ("checkpoint: {writer_nice: 25}",
         r"job.yaml: checkpoint.writer_nice: 25 is neither 'idle' nor a niceness from 0 to 19"),
        ("checkpoint: {writer_nice: lazy}",
         r"job.yaml: checkpoint.writer_nice: 'lazy' is not a whole number or 'lazy' is not one of idle$"),
        ("elastic: {in_process: true, in_process_deadline: 0}", r"job.yaml: elastic.in_process_deadline: .*must be > 0"),
        ("elastic: {global_batch_size: 64}", r"set both elastic.global_batch_size and elastic.micro_batch_size"),
        ("elastic: {global_batch_size: 64, micro_batch_size: 5}", r"64 is not a multiple of elastic.micro_batch_size 5"),
        ("observability: {metrics_port: 70000}", r"observability.metrics_port: port 70000 is outside"),
        ("compile: {share: true}\ncheckpoint: {dir: /tmp/ckpt}", r"job.yaml: compile.share: .*set compile.cache_dir and checkpoint.dir"),
    ],
)
def test_invalid_values_name_file_and_key(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        resolve(tmp_path, text)


def test_missing_config_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.yaml: cannot read the job config"):
        parse_run_args(["--config", str(tmp_path / "nope.yaml"), "train.py"])


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--nnodes", "3:1"], r"^--nnodes: '3:1' has min 3 > max 1"),
        (["--max-restarts", "-2"], r"^--max-restarts: -2 is negative"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:port"], r"^--rdzv-endpoint: 'h:port' is not host:port"),
        (["--set", "checkpoint.keep=many"], r"^--set checkpoint.keep=many: 'many' is not a whole number"),
        (["--set", "checkpoint.kep=3"], r"did you mean 'checkpoint.keep'"),
        (["--set", "elastic.stop_grace=1d"], r"^--set elastic.stop_grace=1d: '1d' is not a duration"),
        (["--set", "launch.log_dir=5"], r"^--set launch.log_dir=5: 5 is not a string$"),
        (["--set", "checkpoint.keep"], r"write --set section.key=value"),
        (["--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout"], r"^--rdzv-conf: .*must have a value"),
    ],
)
def test_invalid_flags_name_the_flag(flags, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_run_args([*flags, "train.py"])


def test_bad_pet_variable_names_the_variable(monkeypatch):
    monkeypatch.setenv("PET_NNODES", "5:2")
    with pytest.raises(ConfigError, match=r"^environment PET_NNODES: '5:2' has min 5 > max 2"):
        parse_run_args(["train.py"])


YAML = """
job: {nnodes: '1:4', max_restarts: 2, nproc_per_node: 3}
rendezvous: {backend: c10d, endpoint: '127.0.0.1:1000', conf: {join_timeout: 30, last_call_timeout: 5}}
"""


def test_precedence_yaml_over_defaults(tmp_path):
    config = resolve(tmp_path, YAML).config
    assert (config.job.nnodes, config.job.max_restarts, config.job.nproc_per_node) == ("1:4", 2, 3)
    assert config.job.monitor_interval == JobConfig().job.monitor_interval


def test_precedence_env_over_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")
    monkeypatch.setenv("PET_NNODES", "2:2")
    config = resolve(tmp_path, YAML).config
    assert (config.job.nnodes, config.job.max_restarts, config.job.nproc_per_node) == ("2:2", 7, 3)


def test_precedence_flag_over_env_over_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("PET_MAX_RESTARTS", "7")
    config = resolve(tmp_path, YAML, "--max_restarts", "9", "--nproc-per-node", "auto").config
    assert config.job.max_restarts == 9
    assert config.job.nproc_per_node == "auto"


def test_rdzv_conf_flag_overrides_yaml_keys_one_by_one(tmp_path):
    config = resolve(tmp_path, YAML, "--rdzv-conf", "last_call_timeout=1").config
    assert config.rendezvous.conf == {"join_timeout": 30, "last_call_timeout": "1"}


def test_set_overrides_any_key_last(tmp_path):
    config = resolve(tmp_path, YAML, "--set", "checkpoint.keep=9", "--set", "restore.replicated=stripe").config
    assert (config.checkpoint.keep, config.restore.replicated) == (9, "stripe")


def test_script_and_its_arguments_pass_through(tmp_path):
    request = parse_run_args(["--nnodes", "1", "train.py", "--lr", "3", "--config", "x"])
    assert request.script == "train.py"
    assert request.script_args == ["--lr", "3", "--config", "x"]


@pytest.mark.parametrize("text, seconds", [(30, 30.0), (2.5, 2.5), ("500ms", 0.5), ("30s", 30.0), ("2m", 120.0), ("1h", 3600.0)])
def test_durations(text, seconds):
    assert parse_seconds(text) == seconds


@pytest.mark.parametrize("text", ["-1", "10 minutes", True, "1d"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_seconds(text)


def test_the_earlier_name_of_staging_is_accepted_with_a_deprecation_warning(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("checkpoint: {dir: /tmp/ck, async_save: false}\n")
    with pytest.warns(DeprecationWarning, match=r"job.yaml: checkpoint.async_save: 'checkpoint.async_save' is "
                                                r"deprecated .* now 'checkpoint.staging'"):
        config = load_config(job, {})
    assert config.checkpoint.staging is False


def test_a_list_key_takes_a_comma_separated_string_as_torchrun_flags_give_lists(tmp_path):
    config = resolve(tmp_path, "launch: {preload: 'torch._dynamo,numpy'}", "--set", "launch.duplicate_stdout_filters=a,b").config
    assert config.launch.preload == ["torch._dynamo", "numpy"]
    assert config.launch.duplicate_stdout_filters == ["a", "b"]


def test_the_schema_file_is_what_torchrevive_schema_prints(capsys):
    with pytest.raises(SystemExit) as exited:
        torchrevive_main(["schema"])
    assert exited.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((CONFIGS / "torchrevive.schema.json").read_text()), (
        "configs/torchrevive.schema.json is stale: torchrevive schema > configs/torchrevive.schema.json")


def schema_problems(document: object) -> list[str]:
    schema = json.loads((CONFIGS / "torchrevive.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(document)]


def test_the_schema_accepts_the_example_config_and_every_spelling_the_loader_takes():
    assert schema_problems(yaml.safe_load((CONFIGS / "local.yaml").read_text())) == []
    assert schema_problems({"job": {"nnodes": 2, "monitor_interval": "500ms"}, "elastic": {"stop_grace": 2.5},
                            "launch": {"preload": "torch._dynamo,numpy", "log_dir": None}}) == []


@pytest.mark.parametrize(
    "document, where",
    [
        ({"checkpoint": {"kep": 3}}, "checkpoint"),
        ({"chekpoint": {"keep": 3}}, ""),
        ({"checkpoint": {"keep": "three"}}, "checkpoint.keep"),
        ({"checkpoint": {"verify": "always"}}, "checkpoint.verify"),
        ({"job": {"monitor_interval": "soon"}}, "job.monitor_interval"),
        ({"job": {"monitor_interval": -1}}, "job.monitor_interval"),
        ({"launch": {"preload": [3]}}, "launch.preload"),
    ],
)
def test_the_schema_rejects_what_the_loader_rejects(tmp_path, document, where):
    problems = schema_problems(document)
    assert problems and all(p.startswith(f"{where}:") for p in problems), problems
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, yaml.safe_dump(document)))
