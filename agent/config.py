"""The job config: one typed tree, loaded from YAML, overridden key by key, validated with errors
that name the key, the value and where it came from.

Every torchrun flag has a home in the tree (see ``launcher/torchrun_flags.py`` for the mapping),
so a YAML file can say anything a torchrun command line can, and ``--print-config`` shows the
whole resolved job. The tree is pydantic models: ``torchrevive schema`` prints their JSON Schema,
which YAML editors use to complete and check a job file.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from agent.checkpoint.writer_priority import check_writer_priority
from agent.timeouts import (
    DEFAULT_JOIN_WAIT_S,
    DEFAULT_PROCESS_GROUP_TIMEOUT_S,
    TORCH_KEEP_ALIVE_MAX_ATTEMPT,
    TORCH_RENDEZVOUS_DEFAULTS_S,
    RecoveryTimeouts,
    default_lease_ttl_s,
    derived_join_wait_s,
    derived_process_group_timeout_s,
)

DEVICE_NPROC_VALUES = ("auto", "cpu", "gpu", "xpu")

# Rendezvous options that torch.distributed.elastic's built-in backends read, and those of the
# etcd3 backend. Options for any other (custom) backend are passed through unchecked.
_DYNAMIC_RDZV_KEYS = frozenset(
    {
        "join_timeout",
        "last_call_timeout",
        "close_timeout",
        "heartbeat_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "read_timeout",
        "timeout",
    }
)
KNOWN_RDZV_CONF_KEYS: dict[str, frozenset[str]] = {
    "c10d": _DYNAMIC_RDZV_KEYS | {"is_host", "store_type"},
    "etcd-v2": _DYNAMIC_RDZV_KEYS | {"protocol", "ssl_cert", "ssl_cert_key", "ca_cert"},
    "etcd": frozenset(
        {"timeout", "last_call_timeout", "protocol", "cert", "key", "cacert", "etcd_prefix"}
    ),
    "static": frozenset({"rank", "timeout"}),
}
KNOWN_RDZV_CONF_KEYS["etcd3"] = KNOWN_RDZV_CONF_KEYS["etcd-v3"] = _DYNAMIC_RDZV_KEYS | {
    "ca_cert", "ssl_cert", "ssl_cert_key", "user", "password", "password_file", "key_prefix", "lease_ttl",
    "heartbeats",
}
SECRET_RDZV_CONF_KEYS = frozenset({"password"})
"""rendezvous.conf keys whose values never leave the agent: redacted in --print-config and in the
config file workers read (TORCHREVIVE_CONFIG)."""
REDACTED = "<redacted>"
_RDZV_DURATION_KEYS = frozenset(k for k in _DYNAMIC_RDZV_KEYS if k.endswith("timeout")) | {
    "keep_alive_interval", "lease_ttl"
}


class ConfigError(ValueError):
    """A job config value is wrong. The message names the source, the key and the fix."""


def parse_nnodes(value: int | str) -> tuple[int, int]:
    """``"MIN:MAX"`` or ``"N"`` -> (min, max); raises ValueError with the rule it broke."""
    parts = str(value).split(":")
    if len(parts) > 2 or not all(re.fullmatch(r"\d+", p.strip()) for p in parts):
        raise ValueError(f"'{value}' is not N or MIN:MAX with whole numbers, e.g. 2 or 1:4")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo <= 0:
        raise ValueError(f"'{value}' has a minimum of {lo}; at least 1 node is needed")
    if lo > hi:
        raise ValueError(f"'{value}' has min {lo} > max {hi}; write MIN:MAX with MIN <= MAX")
    return lo, hi


def parse_seconds(value: Any) -> float:
    """A number of seconds, or a string with a unit (ms, s, m, h) -> seconds."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", str(value))
        if not match:
            raise ValueError(f"'{value}' is not a duration; write e.g. 30, 2.5, '500ms', '30s', '2m'")
        scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[match.group(2) or "s"]
        seconds = float(match.group(1)) * scale
    if seconds < 0:
        raise ValueError(f"'{value}' is negative; a duration must be >= 0")
    return seconds


def parse_endpoints(value: str) -> list[tuple[str, int | None]]:
    """``"host[:port][,host[:port]...]"`` -> [(host, port)]; IPv6 hosts in brackets."""
    endpoints = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+)(?::(\d+))?\s*", item)
        if not match:
            raise ValueError(f"'{item}' is not host:port, e.g. 127.0.0.1:29400")
        port = int(match.group(2)) if match.group(2) is not None else None
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"'{item}' has port {port}; a port is 0..65535")
        endpoints.append((match.group(1), port))
    return endpoints


def _comma_list(value: Any) -> Any:
    """A comma-separated string as a list, as torchrun's flags give lists; anything else as is."""
    return [item for item in value.split(",") if item] if isinstance(value, str) else value


def _string_keys(value: Any) -> Any:
    """A mapping's keys as strings (YAML reads ``1: x`` as an int key); anything else as is."""
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else value


_DURATION_PATTERN = r"^\s*\d+(\.\d+)?\s*(ms|s|m|h)?\s*$"
Seconds = Annotated[
    float,
    BeforeValidator(parse_seconds),
    WithJsonSchema({"anyOf": [{"type": "number", "minimum": 0}, {"type": "string", "pattern": _DURATION_PATTERN}],
                    "description": "seconds: a number, or a string with a unit: '500ms', '30s', '2m', '1h'"}),
]
"""A duration in seconds. YAML and overrides accept a number or a string with a unit:
``"500ms"``, ``"30s"``, ``"2m"``, ``"1h"``."""
StringList = Annotated[
    list[str],
    BeforeValidator(_comma_list),
    WithJsonSchema({"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}],
                    "description": "a list of strings, or one string of them separated by commas"}),
]
StringKeyed = Annotated[dict[str, Any], BeforeValidator(_string_keys)]


class _Section(BaseModel):
    """A part of the job config: its keys typed and checked strictly (``true`` is not a number, a
    number is not a string), on load and on every assignment; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, use_attribute_docstrings=True)


class JobSection(_Section):
    """Who the job is and how big it may be (torchrun: --rdzv-id, --nnodes, --nproc-per-node,
    --max-restarts, --monitor-interval, --role)."""

    id: str = "none"
    nnodes: int | str = "1:1"
    nproc_per_node: int | str = 1
    max_restarts: int = 0
    monitor_interval: Seconds = 0.1
    role: str = "default"


class RendezvousSection(_Section):
    """The rendezvous backend (torchrun: --rdzv-backend, --rdzv-endpoint, --rdzv-conf,
    --standalone). ``conf`` uses torchrun's rdzv-conf key names; durations in seconds."""

    backend: str = "static"
    endpoint: str = ""
    conf: StringKeyed = Field(default_factory=dict)
    standalone: bool = False


class LaunchSection(_Section):
    """How workers are started and where their output goes: the remaining torchrun flags, with
    torchrun's names and defaults."""

    start_method: Literal["spawn", "fork", "forkserver"] = "spawn"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str = ""
    duplicate_stdout_filters: StringList = Field(default_factory=list)
    duplicate_stderr_filters: StringList = Field(default_factory=list)
    logs_specs: str | None = None
    event_log_handler: str = "null"
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    numa_binding: str | None = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    shutdown_timeout: int | None = None
    virtual_local_rank: bool = False
    warm_workers: bool = True
    """Fork each round's workers from a warm process that has imported torch (not a torchrun flag)."""
    preload: StringList = Field(default_factory=lambda: ["torch._dynamo"])
    """Modules the warm process imports after torch and torchrevive's worker API: the training
    script's heavy imports (torch._dynamo: DDP's constructor and torch.compile import it)."""


class CheckpointSection(_Section):
    """Where and how often snapshots are written, and how many are kept."""

    dir: str | None = None
    interval_steps: int = 100
    keep: int = 3
    staging: bool = True
    on_busy: Literal["wait", "skip"] = "wait"
    verify: Literal["off", "sample", "full"] = "sample"
    writer_nice: int | Literal["idle"] = 10
    """How low the threads that write snapshots in the background run: a niceness from 0
    (training's priority) to 19, or idle (Linux's SCHED_IDLE: only on CPU time training leaves)."""
    write_threads: int = 2
    """Snapshot writes in flight at once per rank (torchsnapshot's default: 16)."""
    direct_io: bool = True
    """Write snapshot files around the page cache (O_DIRECT) where the file system allows it: less
    CPU taken from training while a save runs; a restore on the same node then reads the disk."""
    memory_interval_steps: int = 0
    """A memory snapshot (node RAM, with a replica on a peer node) every this many steps; 0: off."""
    memory_dir: str | None = None
    """Where a node's agent makes its run's memory directory, torchrevive-<job.id> (default:
    /dev/shm): a tmpfs of this user's or root's that no other user can write to unless it is
    sticky. The directory is the live agent's alone: removed at its end, or by the run's next agent
    on the node when its agent died."""
    memory_secret_file: str | None = None
    """A file (mode 600) holding the secret agents prove to each other; default: one drawn by the
    first agent and shared through the rendezvous store."""


class RestoreSection(_Section):
    """How each rank reads its share of a snapshot."""

    io_threads: int | None = None
    replicated: Literal["all", "stripe"] = "all"
    trust_pickles: bool = False
    prefetch: bool = True
    pinned_mb: int = 256
    """Pinned host memory (MiB) a rank may use to stage CUDA destinations while it restores."""


class ElasticSection(_Section):
    """Which world sizes are valid, and the global batch to keep across them."""

    world_size_multiple_of: int = 1
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    stop_grace: Seconds = 3.0
    """How long workers get after SIGTERM before SIGKILL when the agent stops them."""
    join_wait: Seconds = DEFAULT_JOIN_WAIT_S
    """A joining node is admitted at the next committed snapshot (memory or storage) when the
    commit notice says one is due within this long: training goes on meanwhile, and the restart
    then loses only the steps trained while the workers stop. 0: admitted at once (so are
    in-process joins). Unset: half of what rendezvous.conf.join_timeout leaves after the last call
    (285 s with torch's defaults)."""
    in_process: bool = False
    """Survivors of a membership change keep their processes: their workers leave the round and
    re-form in the next one (a training script written with ``agent.run_resilient``); a node
    whose workers do not all leave within ``in_process_deadline`` restarts them."""
    in_process_deadline: Seconds = 5.0
    """How long a node's workers get to leave a round; at a join, up to half of it goes to
    finishing the step in flight."""
    rehearse_joins: bool = True
    """With in_process: a node joining a running job starts its workers before it asks to join;
    they run the script's warm-up (``agent.run_resilient(warmup=...)``: build, shard, compile) in a
    round of this node alone while the job trains, and are handed their first round in-process."""
    rehearsal_deadline: Seconds = 300.0
    """How long a rehearsal may take; beyond it the node joins with workers started anew."""
    process_group_timeout: Seconds = DEFAULT_PROCESS_GROUP_TIMEOUT_S
    """The timeout of the workers' process groups (``WorkerContext.process_group_timeout``; used by
    ``agent.run_resilient``). Unset: 600 s, or twice hung-node detection + stop_grace if longer."""


class CompileSection(_Section):
    """Where torch.compile's caches live on each node (:mod:`agent.compile_cache`). Cache entries
    are code the workers run: nothing is kept or shared unless the job says so."""

    cache_dir: str | None = None
    """A directory on this node that outlives its workers (and, in a container, the container):
    the workers' inductor caches go there, so a worker restarted on the node compiles from them.
    None: torch's own default (a directory under /tmp)."""
    share: bool = False
    """With ``cache_dir``: the round's leader keeps a copy of its node's caches in the checkpoint
    directory after each commit, and a node whose caches are empty starts from it. Whoever can
    write the checkpoint directory can then run code on every node."""


class ObservabilitySection(_Section):
    """Where recovery events go. The metrics port is unauthenticated: bind it to a private
    address."""

    event_log: str | None = None
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"


class JobConfig(_Section):
    """A torchrevive job config (``torchrevive run --config job.yaml``), section by section."""

    job: JobSection = Field(default_factory=JobSection)
    rendezvous: RendezvousSection = Field(default_factory=RendezvousSection)
    launch: LaunchSection = Field(default_factory=LaunchSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    restore: RestoreSection = Field(default_factory=RestoreSection)
    elastic: ElasticSection = Field(default_factory=ElasticSection)
    compile: CompileSection = Field(default_factory=CompileSection)
    observability: ObservabilitySection = Field(default_factory=ObservabilitySection)

    @property
    def min_max_nodes(self) -> tuple[int, int]:
        """``job.nnodes`` as (min, max); valid once the config is validated."""
        return parse_nnodes(self.job.nnodes)

    def get(self, path: str) -> Any:
        """The value at a dotted key path, e.g. ``"checkpoint.keep"``."""
        section, name = _split_path(path)
        return getattr(getattr(self, section), name)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts, ready for YAML."""
        return self.model_dump()

    def to_yaml(self) -> str:
        """The resolved config as YAML, loadable by :func:`load_config`, secrets redacted."""
        document = self.to_dict()
        conf = document["rendezvous"]["conf"]
        for key in SECRET_RDZV_CONF_KEYS & conf.keys():
            conf[key] = REDACTED
        return yaml.safe_dump(document, sort_keys=False)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a job config file (``torchrevive schema``), for YAML editors."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **JobConfig.model_json_schema()}


def load_config(path: str | Path | None, sources: dict[str, str] | None = None) -> JobConfig:
    """Read a YAML job config (None: the defaults). Each key the file sets is recorded in
    ``sources`` (key path -> "file: key") for later messages; :func:`validate` checks the rules
    between keys."""
    if path is None:
        return JobConfig()
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the job config ({exc.strerror}); check --config") from exc
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, e.g. 'job:'")
    sections = list(JobConfig.model_fields)
    for section, values in document.items():
        if section not in sections:
            raise ConfigError(f"{source}: unknown section '{section}'{_did_you_mean(str(section), sections)}")
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of keys")
    document = {section: _current_names(section, values, source) for section, values in document.items() if values}
    try:
        config = JobConfig.model_validate(document)
    except ValidationError as exc:
        errors = exc.errors()
        section, name = errors[0]["loc"][:2]
        key = f"{section}.{name}"
        errors = [error for error in errors if error["loc"][:2] == (section, name)]
        raise ConfigError(f"{source}: {key}: {_problem(key, document[section].get(name), errors)}") from None
    if sources is not None:
        for section, values in document.items():
            for name, value in values.items():
                key = f"{section}.{name}"
                sources[key] = f"{source}: {key}"
                if key == "rendezvous.conf":
                    sources.update({f"{key}.{option}": f"{source}: {key}.{option}" for option in value})
    return config


RENAMED_KEYS = {"checkpoint.async_save": "checkpoint.staging"}
"""Earlier names of keys (each in its key's section), accepted with a DeprecationWarning until 0.3."""


def set_value(config: JobConfig, path: str, value: Any, *, source: str) -> None:
    """Set one key, checked against the key's type; errors name ``source``."""
    path = _current_name(path, source)
    if path not in _fields():
        raise ConfigError(f"{source}: unknown key{_did_you_mean(path, _fields())}")
    section, name = _split_path(path)
    try:
        setattr(getattr(config, section), name, value)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_problem(path, value, exc.errors())}") from None


def parse_override(assignment: str) -> tuple[str, Any]:
    """``"section.key=value"`` (a ``--set`` argument) -> (path, value parsed as YAML)."""
    path, sep, raw = assignment.partition("=")
    if not sep or not path.strip():
        raise ConfigError(f"--set {assignment}: write --set section.key=value, e.g. --set checkpoint.keep=5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {assignment}: the value is not valid YAML: {exc}") from exc
    return path.strip(), value


def validate(config: JobConfig, sources: dict[str, str]) -> None:
    """Check the rules between and within keys; ``sources`` maps a key path to where its value
    came from (file and key, flag, or environment variable) for the message."""

    def fail(path: str, problem: str) -> typing.NoReturn:
        raise ConfigError(f"{sources.get(path, f'default {path}')}: {problem}")

    try:
        parse_nnodes(config.job.nnodes)
    except ValueError as exc:
        fail("job.nnodes", str(exc))
    nproc = config.job.nproc_per_node
    if not (isinstance(nproc, int) and nproc >= 1) and nproc not in DEVICE_NPROC_VALUES:
        fail("job.nproc_per_node", f"'{nproc}' must be a whole number >= 1 or one of {', '.join(DEVICE_NPROC_VALUES)}")
    for path in ("job.max_restarts", "launch.node_rank"):
        if config.get(path) < 0:
            fail(path, f"{config.get(path)} is negative; use 0 or more")
    if config.job.monitor_interval <= 0:
        fail("job.monitor_interval", "must be > 0 seconds")
    _validate_rendezvous(config, sources, fail)
    for path in ("checkpoint.interval_steps", "checkpoint.keep", "checkpoint.write_threads",
                 "elastic.world_size_multiple_of", "restore.pinned_mb"):
        if config.get(path) < 1:
            fail(path, f"{config.get(path)} must be >= 1")
    if wrong := check_writer_priority(config.checkpoint.writer_nice):
        fail("checkpoint.writer_nice", wrong)
    if config.checkpoint.memory_interval_steps < 0:
        fail("checkpoint.memory_interval_steps", f"{config.checkpoint.memory_interval_steps} must be >= 0 (0: off)")
    if config.checkpoint.memory_interval_steps and not config.checkpoint.dir:
        fail("checkpoint.memory_interval_steps", "the memory tier needs checkpoint.dir too (the storage tier it falls back on)")
    if config.compile.share and not (config.compile.cache_dir and config.checkpoint.dir):
        fail("compile.share", "shares the node's caches through the checkpoint directory: set compile.cache_dir and "
                              "checkpoint.dir too")
    for path in ("restore.io_threads", "elastic.global_batch_size", "elastic.micro_batch_size"):
        if config.get(path) is not None and config.get(path) < 1:
            fail(path, f"{config.get(path)} must be >= 1 (or leave it unset)")
    for path in ("launch.master_port", "observability.metrics_port"):
        port = config.get(path)
        if port is not None and not 0 <= port <= 65535:
            fail(path, f"port {port} is outside 0..65535")
    if config.launch.shutdown_timeout is not None and config.launch.shutdown_timeout < 0:
        fail("launch.shutdown_timeout", "must be >= 0 seconds")
    for path in ("elastic.in_process_deadline", "elastic.rehearsal_deadline"):
        if config.get(path) <= 0:
            fail(path, "must be > 0 seconds")
    if config.elastic.join_wait < 0:
        fail("elastic.join_wait", "must be >= 0 seconds (0: a joining node is admitted at once)")
    elastic = config.elastic
    if (elastic.global_batch_size is None) != (elastic.micro_batch_size is None):
        fail("elastic.global_batch_size", "set both elastic.global_batch_size and elastic.micro_batch_size, or neither")
    if elastic.global_batch_size is not None and elastic.global_batch_size % elastic.micro_batch_size:
        fail("elastic.global_batch_size", f"{elastic.global_batch_size} is not a multiple of elastic.micro_batch_size {elastic.micro_batch_size}")
    _resolve_timeouts(config, sources, fail)


TIMED_BACKENDS = frozenset({"static", "c10d", "etcd-v2", "etcd3", "etcd-v3"})
"""The backends torch's dynamic rendezvous runs (static: a job of one node, on a local c10d store):
those the rendezvous timeouts below apply to."""


def recovery_timeouts(config: JobConfig) -> RecoveryTimeouts | None:
    """The timeouts that bound this job's recoveries, torch's defaults where the job sets none; None
    for a backend that is not torch's dynamic rendezvous (torch's etcd v1, a custom one)."""
    if config.rendezvous.backend not in TIMED_BACKENDS:
        return None
    conf = config.rendezvous.conf

    def seconds(key: str) -> float:
        return parse_seconds(conf[key]) if key in conf else TORCH_RENDEZVOUS_DEFAULTS_S[key]

    interval = seconds("keep_alive_interval")
    attempts = int(conf.get("keep_alive_max_attempt", TORCH_KEEP_ALIVE_MAX_ATTEMPT))
    lease_ttl = None
    if config.rendezvous.backend in ("etcd3", "etcd-v3"):
        lease_ttl = parse_seconds(conf["lease_ttl"]) if "lease_ttl" in conf else default_lease_ttl_s(interval, attempts)
    low, high = config.min_max_nodes
    return RecoveryTimeouts(
        keep_alive_interval=interval, keep_alive_max_attempt=attempts, heartbeat_timeout=seconds("heartbeat_timeout"),
        join_timeout=seconds("join_timeout"), last_call_timeout=seconds("last_call_timeout"),
        join_wait=config.elastic.join_wait, stop_grace=config.elastic.stop_grace,
        in_process_deadline=config.elastic.in_process_deadline,
        process_group_timeout=config.elastic.process_group_timeout, lease_ttl=lease_ttl, grows=low < high)


def _resolve_timeouts(config: JobConfig, sources: dict[str, str], fail: Any) -> None:
    """Derive the timeouts the job left unset from those it set, then check their order: a rule
    broken by torchrun's own rendezvous keys from the command line is a warning (torchrun runs
    such a job as given); any other stops the launch."""
    try:
        timeouts = recovery_timeouts(config)
    except (TypeError, ValueError):  # the durations are checked already: the heartbeat count is left
        fail("rendezvous.conf.keep_alive_max_attempt", "must be a whole number of heartbeats, e.g. 3")
    if timeouts is None:
        return
    if "elastic.join_wait" not in sources:
        config.elastic.join_wait = derived_join_wait_s(timeouts.join_timeout, timeouts.last_call_timeout)
    if "elastic.process_group_timeout" not in sources:
        config.elastic.process_group_timeout = derived_process_group_timeout_s(
            timeouts.detection_s, config.elastic.stop_grace)
    timeouts = dataclasses.replace(timeouts, join_wait=config.elastic.join_wait,
                                   process_group_timeout=config.elastic.process_group_timeout)
    for rule in timeouts.rule_breaks():
        if all(_torchruns_own(key, sources) for key in rule.keys):
            warnings.warn(f"{sources.get(rule.keys[0], f'default {rule.keys[0]}')}: {rule.problem}", stacklevel=3)
        else:
            fail(rule.keys[0], rule.problem)


def _torchruns_own(key: str, sources: dict[str, str]) -> bool:
    """Whether ``key`` is one of torch's rendezvous keys, left at torch's default or given as
    torchrun takes it (its command line or a PET_* variable; not our --set)."""
    source = sources.get(key)
    return key.removeprefix("rendezvous.conf.") in _DYNAMIC_RDZV_KEYS and (
        source is None or (source.startswith(("--", "environment ")) and not source.startswith("--set ")))


def _validate_rendezvous(config: JobConfig, sources: dict[str, str], fail: Any) -> None:
    rdzv = config.rendezvous
    if rdzv.endpoint:
        try:
            parse_endpoints(rdzv.endpoint)
        except ValueError as exc:
            fail("rendezvous.endpoint", str(exc))
    elif rdzv.backend not in ("static", "c10d") and not rdzv.standalone:
        fail("rendezvous.endpoint", f"backend '{rdzv.backend}' needs an endpoint, e.g. --rdzv-endpoint 127.0.0.1:2379")
    known = KNOWN_RDZV_CONF_KEYS.get(rdzv.backend)
    for key, value in list(rdzv.conf.items()):
        if known is not None and key not in known:
            problem = f"unknown option '{key}' for rendezvous backend '{rdzv.backend}'{_did_you_mean(key, known)}"
            given_by = sources.get(f"rendezvous.conf.{key}", "")
            if not given_by.startswith(("--", "environment ")):
                fail("rendezvous.conf", problem)
            # torchrun hands its handler every key and the handler ignores those it does not know:
            # a command line that runs under torchrun runs here too.
            warnings.warn(f"{given_by}: {problem}; ignored, as torchrun ignores it", stacklevel=2)
            del rdzv.conf[key]
            continue
        if key in _RDZV_DURATION_KEYS:
            try:
                seconds = parse_seconds(value)
            except ValueError as exc:
                fail("rendezvous.conf", f"{key}: {exc}")
            if seconds != int(seconds):
                fail("rendezvous.conf", f"{key}: {value} is not whole seconds; torch's rendezvous takes whole seconds")


def rdzv_conf_for_torch(conf: dict[str, Any]) -> dict[str, Any]:
    """``rendezvous.conf`` as torch's rendezvous reads it: durations as whole seconds."""
    return {key: int(parse_seconds(value)) if key in _RDZV_DURATION_KEYS else value for key, value in conf.items()}


def _current_name(path: str, source: str) -> str:
    """``path``, or the key it was renamed to, with a DeprecationWarning naming ``source``."""
    if path not in RENAMED_KEYS:
        return path
    warnings.warn(f"{source}: '{path}' is deprecated and will be removed in 0.3: it is now "
                  f"'{RENAMED_KEYS[path]}'", DeprecationWarning, stacklevel=3)
    return RENAMED_KEYS[path]


def _current_names(section: str, values: dict[Any, Any], source: str) -> dict[Any, Any]:
    """A section of a config file with renamed keys under their current names."""
    return {_split_path(_current_name(f"{section}.{name}", f"{source}: {section}.{name}"))[1]: value
            for name, value in values.items()}


_TYPE_PROBLEMS = {
    "int_type": "is not a whole number",
    "float_type": "is not a number",
    "bool_type": "is not true or false",
    "string_type": "is not a string",
    "dict_type": "is not a mapping of key: value",
}


def _problem(path: str, value: Any, errors: list[ErrorDetails]) -> str:
    """What is wrong with ``value`` for the key ``path``, from pydantic's errors for that key (one
    per member of a union), in the config's own words."""
    if path not in _fields():  # pydantic's extra_forbidden
        return f"unknown key{_did_you_mean(path, _fields())}"
    annotation = _fields()[path].annotation
    problems: list[str] = []
    for error in errors:
        if error["type"] == "value_error":  # a check of ours (a duration): its message as it is
            problem = str(error["ctx"]["error"])
        elif error["type"] == "literal_error":
            problem = f"{value!r} is not one of {', '.join(map(str, _literal_values(annotation)))}"
        elif typing.get_origin(annotation) is list:
            problem = f"{value!r} is not a list of strings"
        else:
            problem = f"{value!r} {_TYPE_PROBLEMS.get(error['type'], 'is wrong: ' + error['msg'])}"
        if problem not in problems:
            problems.append(problem)
    return " or ".join(problems)


def _literal_values(annotation: Any) -> tuple[Any, ...]:
    """The values a ``Literal`` allows, or the ``Literal`` members of a union allow."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    return tuple(value for member in typing.get_args(annotation) if typing.get_origin(member) is Literal
                 for value in typing.get_args(member))


@functools.cache
def _fields() -> dict[str, FieldInfo]:
    """Every settable key's field, by ``section.name``, in the config's order."""
    return {f"{section}.{name}": field
            for section, info in JobConfig.model_fields.items()
            for name, field in typing.cast(type[BaseModel], info.annotation).model_fields.items()}


def _split_path(path: str) -> tuple[str, str]:
    section, _, name = path.partition(".")
    return section, name


def _did_you_mean(word: str, candidates: typing.Iterable[str]) -> str:
    candidates = list(candidates)
    # A right key name in the wrong section ("job.keep") is the likeliest slip; then typos.
    close = [c for c in candidates if "." in word and c.rsplit(".", 1)[-1] == word.rsplit(".", 1)[-1]][:1]
    close = close or difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
