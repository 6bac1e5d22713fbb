"""Run a resolved job: torchrun's LaunchConfig, our RecoveryAgent in place of LocalElasticAgent."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed import run as torchrun
from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT as C10D_DEFAULT_PORT
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig

from agent.config import JobConfig
from agent import torch_private
from agent.recovery_agent import RecoveryAgent, tcp_store_on
from agent.rendezvous import etcd3_backend
from launcher.torchrun_flags import RunRequest, torchrun_namespace


def build_launch(request: RunRequest) -> tuple[LaunchConfig, Callable[..., Any] | str, list[str]]:
    """torchrun's (LaunchConfig, entrypoint, args) for the request, built by torchrun's own code
    from the namespace torchrun would have parsed."""
    assert request.script is not None, "a job to launch needs a script"
    namespace = torchrun_namespace(request.config, request.script, request.script_args)
    return torchrun.config_from_args(namespace)


def launch(request: RunRequest) -> dict[int, Any]:
    """Launch the job and block until it ends; the workers' return values by global rank.

    Raises ChildFailedError (with torchrun's error summary) when workers fail for good.
    """
    launch_config, entrypoint, args = build_launch(request)
    with tempfile.TemporaryDirectory(prefix="torchrevive-") as run_dir:
        config_path = Path(run_dir) / "job.yaml"
        config_path.write_text(request.config.to_yaml())
        return run_agent(launch_config, entrypoint, args, job=request.config, config_path=str(config_path))


def run_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: list[str],
    *,
    job: JobConfig,
    config_path: str,
) -> dict[int, Any]:
    """Run a RecoveryAgent for one node, as torch's ``launch_agent`` runs a LocalElasticAgent."""
    # As torch's launch_agent, first: torch's worker processes context reads it when it starts workers,
    # and turns those signals into SignalException, on which the agent forwards the signal to them.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    if config.rdzv_backend in etcd3_backend.NAMES:
        etcd3_backend.register()  # normally done by the entry point, unless the package is not installed
    master_addr, master_port = _static_master(rdzv_parameters)
    store_server = _host_c10d_store(rdzv_parameters)  # noqa: F841 (serves while the agent runs)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    agent = RecoveryAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
        job=job,
        config_path=config_path,
    )
    shutdown_rendezvous = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            raise ChildFailedError(name=_entrypoint_name(entrypoint, args), failures=result.failures)
        return result.return_values
    except ChildFailedError:
        raise
    except SignalException:
        # The agent was told to stop: leave the rendezvous open for the nodes that go on.
        shutdown_rendezvous = False
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if shutdown_rendezvous:
            spec.rdzv_handler.shutdown()


def _host_c10d_store(params: RendezvousParameters) -> dist.TCPStore | None:
    """When this node hosts the c10d backend's store, host it here, listening on the endpoint's
    address alone, and let torch's backend connect to it as a client: torch's own listens on every
    interface. Decides as torch does: ``is_host`` when given, else whether the endpoint names this
    machine; a taken port then means another agent here hosts it."""
    if params.backend != "c10d" or params.get("store_type", "tcp") != "tcp":
        return None
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=C10D_DEFAULT_PORT)
    explicit = params.get_as_bool("is_host")
    if not (explicit if explicit is not None else torch_private.hosts_c10d_store(host)):
        return None
    try:
        server = tcp_store_on(host, port)
    except OSError as exc:
        if explicit:
            raise ValueError(f"rendezvous endpoint {params.endpoint}: cannot host the c10d store there "
                             f"({exc.strerror}); free the port, or set is_host=false on all nodes but one") from exc
        return None
    params.endpoint, params.config["is_host"] = f"{host}:{server.port}", False
    return server


def _static_master(params: RendezvousParameters) -> tuple[str | None, int | None]:
    """MASTER_ADDR/PORT for the static backend (others learn them from the rendezvous)."""
    if params.backend != "static":
        return None, None
    host, port = parse_rendezvous_endpoint(params.endpoint.strip(), default_port=-1)
    if port == -1:
        raise ValueError(f"rendezvous endpoint '{params.endpoint}' has no port; give --master-port")
    return host, port


def _entrypoint_name(entrypoint: Callable[..., Any] | str, args: list[str]) -> str:
    if callable(entrypoint):
        return entrypoint.__name__
    if "python" in Path(entrypoint).name:
        return next((a for a in args if not a.startswith("-")), entrypoint)
    return entrypoint
