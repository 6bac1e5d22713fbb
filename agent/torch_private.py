"""Every private part of torch that torchrevive reaches into, in one place: in
torch.distributed.elastic, the dynamic rendezvous's state, state holder and operation executor
(the prompt re-rendezvous, the membership watch, the node ledger, etcd3's round state and outage
tolerance), the agent's health check and store binding, and the worker processes' handler factory
(warm workers); in torch.distributed.tensor, the strided shard placement of FSDP2 over tensor
parallelism; in torch.distributed, the abort of process groups and the counter that names them;
dynamo's compile counters. Nothing else in the package names a private torch attribute or class,
except the private methods and attributes that subclasses of torch's classes override, call or
read as their own (``self._...``): :data:`PRIVATE_METHODS` and :data:`PRIVATE_ATTRIBUTES` list
them all, and a test checks the list against the code and against torch's signatures.

Each was read in torch 2.13, the only torch the package declares and tests (``torch>=2.13,<2.14``);
another torch warns once, at import, because these names may have changed there (the tests then
tell what broke). The imports here stay those torch's rendezvous package can satisfy while it is
still importing (it loads the etcd3 backend, an entry point, from there).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.elastic.events import construct_and_record_rdzv_event
from torch.distributed.elastic.events.api import NodeState
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action as RendezvousAction
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _DistributedRendezvousOpExecutor as DistributedRendezvousOpExecutor,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc as NodeDesc
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousContext as RendezvousContext
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp as RendezvousExitOp
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousJoinOp as RendezvousJoinOp
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState as RendezvousState
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config as parse_rendezvous_config

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

__all__ = ["DistributedRendezvousOpExecutor", "NodeDesc", "RendezvousAction", "RendezvousContext",
           "RendezvousExitOp", "RendezvousJoinOp", "RendezvousState", "parse_rendezvous_config"]

READ_IN = (2, 13)
"""The torch (major, minor) whose private code this module was written against."""

_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent"
_OP_EXECUTOR = "torch.distributed.elastic.rendezvous.dynamic_rendezvous._DistributedRendezvousOpExecutor"
_SUBPROCESS_HANDLER = "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler.SubprocessHandler"

PRIVATE_METHODS: dict[str, dict[str, str]] = {
    _AGENT: {  # RecoveryAgent overrides the first eight (torch's run loop calls them) and calls the rest
        "_assign_worker_ranks": "(self, store, group_rank: int, group_world_size: int, "
                                "spec: torch.distributed.elastic.agent.server.api.WorkerSpec) -> "
                                "list[torch.distributed.elastic.agent.server.api.Worker]",
        "_initialize_workers": "(self, worker_group: torch.distributed.elastic.agent.server.api.WorkerGroup) -> None",
        "_invoke_run": "(self, role: str = 'default') -> torch.distributed.elastic.agent.server.api.RunResult",
        "_monitor_workers": "(self, worker_group: 'WorkerGroup') -> 'RunResult'",
        "_rendezvous": "(self, worker_group: torch.distributed.elastic.agent.server.api.WorkerGroup) -> None",
        "_setup_healthcheck": "(self) -> 'None'",
        "_start_workers": "(self, worker_group: 'WorkerGroup') -> 'dict[int, Any]'",
        "_stop_workers": "(self, worker_group: 'WorkerGroup') -> 'None'",
        "_shutdown": "(self, death_sig: 'signal.Signals' = <Signals.SIGTERM: 15>, timeout: 'int' = 30) -> 'None'",
        "_exit_barrier": "(self)",
        "_get_alive_time": "(self) -> 'int'",
    },
    _OP_EXECUTOR: {  # PromptOpExecutor overrides it
        "_record": "(self, message: str, node_state: torch.distributed.elastic.events.api.NodeState = "
                   "<NodeState.RUNNING: 'RUNNING'>) -> None",
    },
    _SUBPROCESS_HANDLER: {  # the warm workers' handlers override it
        "_popen": "(self, args: tuple, env: dict[str, str]) -> subprocess.Popen",
    },
}
"""Every private method of a torch class that a subclass here overrides (torch calls it, so its
signature is a contract) or that the package calls, with its signature in torch 2.13
(``tests/test_torch_private.py`` fails where torch's differs)."""

PRIVATE_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    _AGENT: ("_exit_barrier", "_pcontext", "_remaining_restarts", "_shutdown", "_worker_group"),
    _OP_EXECUTOR: ("_keep_alive", "_node", "_settings", "_state", "_state_holder"),
    _SUBPROCESS_HANDLER: ("_stderr", "_stdout"),
}
"""The private attributes of those classes that the subclasses (RecoveryAgent, PromptOpExecutor,
the warm workers' handlers) read or set as ``self._...`` (``_remaining_restarts`` becomes a
property of RecoveryAgent)."""


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


if _version() != READ_IN:
    warnings.warn(f"torchrevive's agent uses private parts of torch.distributed.elastic as torch "
                  f"{READ_IN[0]}.{READ_IN[1]} has them; torch {torch.__version__} may differ (see "
                  "agent/torch_private.py)", RuntimeWarning, stacklevel=2)


def alive_time(agent: LocalElasticAgent) -> Callable[[], int]:
    """torch's health-check callback: the worker watchdog's last progress time, else now."""
    return agent._get_alive_time


def set_health_check_server(agent: LocalElasticAgent, server: Any) -> None:
    """Give ``agent`` the server torch's own code stops when the agent shuts down."""
    agent._health_check_server = server


@contextlib.contextmanager
def health_check_server_kept(agent: LocalElasticAgent) -> Iterator[None]:
    """Within: torch's ``_shutdown`` (which also stops the health-check server) leaves it serving."""
    server, agent._health_check_server = agent._health_check_server, None
    try:
        yield
    finally:
        agent._health_check_server = server


@contextlib.contextmanager
def subprocess_handlers(factory: Callable[..., Any]) -> Iterator[None]:
    """Within: torch's SubprocessContext makes each worker's SubprocessHandler with ``factory``
    (called with the keyword arguments of torch's ``get_subprocess_handler``) instead of its own."""
    from torch.distributed.elastic.multiprocessing import api as multiprocessing_api

    original = multiprocessing_api.get_subprocess_handler
    multiprocessing_api.get_subprocess_handler = factory
    try:
        yield
    finally:
        multiprocessing_api.get_subprocess_handler = original


@contextlib.contextmanager
def worker_environment_added(environment: Mapping[str, str]) -> Iterator[None]:
    """Within: LocalElasticAgent's ``_start_workers`` starts each worker with ``environment``
    added to the variables torch sets for it (torch's value wins for a name both set), spawned,
    forked or run as a function alike, without touching this process's own environment."""
    from torch.distributed.elastic.agent.server import local_elastic_agent

    original = local_elastic_agent.start_processes

    def start_processes(*args: Any, envs: dict[int, dict[str, str]], **kwargs: Any) -> Any:
        return original(*args, envs={rank: {**environment, **env} for rank, env in envs.items()}, **kwargs)

    local_elastic_agent.start_processes = start_processes
    try:
        yield
    finally:
        local_elastic_agent.start_processes = original


def this_node(handler: DynamicRendezvousHandler) -> str:
    """The handler's node as torch names it in the rendezvous state (``addr_pid_localid``)."""
    return repr(handler._this_node)


def record_rendezvous_event(owner: object, node: NodeDesc, run_id: str, message: str,
                            node_state: NodeState = NodeState.RUNNING, rank: int | None = None) -> None:
    """torch's rendezvous event, named as torch names it: ``Class.method`` of the method that
    records it, read from that method's frame. torch's own ``get_method_name`` walks the whole
    stack twice, reading every frame's source line, on each state change and keep-alive of every
    node: at 128 emulated nodes that was 40% of the rendezvous' time, for an event dropped unless
    an events handler is configured."""
    method = sys._getframe(2).f_code.co_name
    construct_and_record_rdzv_event(name=f"{type(owner).__name__}.{method}", run_id=run_id, message=message,
                                    node_state=node_state, hostname=node.addr, pid=node.pid, local_id=node.local_id,
                                    rank=rank)


def record_handler_events_cheaply(handler: DynamicRendezvousHandler) -> None:
    """``handler``'s own events (one per rendezvous) through :func:`record_rendezvous_event`."""

    def record(message: str, node_state: NodeState = NodeState.RUNNING, rank: int | None = None) -> None:
        record_rendezvous_event(handler, handler._this_node, handler._settings.run_id, message, node_state, rank)

    handler._record = record


def rendezvous_store(handler: DynamicRendezvousHandler) -> Any:
    """The store ``handler`` was made with (c10d's TCPStore, etcd3's store), before torch wraps it
    in a round's prefix."""
    return handler._store


def round_key(handler: DynamicRendezvousHandler, round: int, key: str) -> str:
    """``key`` of the store torch gives the agents of rendezvous round ``round``, as named in the
    handler's store (torch's ``_wrap_store`` prefixes it so, through a PrefixStore)."""
    return run_round_key(handler.settings.run_id, round, key)


def run_round_key(run_id: str, round: int, key: str) -> str:
    """:func:`round_key` for run ``run_id``, read from outside its agents."""
    return f"torch.rendezvous.{run_id}.{round}/{key}"


def c10d_state_key(run_id: str) -> str:
    """The key torch's c10d rendezvous backend keeps run ``run_id``'s state under."""
    return f"torch.rendezvous.{run_id}"


_ROLE_INFO, _ASSIGNED_RANKS = "torchelastic/role_info/{}", "torchelastic/assigned_ranks/{}"
"""The keys of torch's rank assignment in a round's store, by node (group rank)."""

C10D_NO_STATE = C10dRendezvousBackend._NULL_SENTINEL.encode()
"""What torch's c10d backend stores as the state until a node writes one."""


def rank_assignment_keys(spec: WorkerSpec, group_rank: int, group_world_size: int) -> tuple[str, bytes, list[str]] | None:
    """What torch's ``SimpleElasticAgent._assign_worker_ranks`` writes in a round's store, and then
    reads with a blocking call: this node's role key and value, and the keys it reads (every node's
    role on the round's first node, the ranks that node assigned it on the others). None where torch
    uses no store for it (``TORCH_ELASTIC_WORKER_IDENTICAL=1``)."""
    from torch.distributed.elastic.agent.server.api import _RoleInstanceInfo as RoleInstanceInfo

    if os.environ.get("TORCH_ELASTIC_WORKER_IDENTICAL", "0") == "1":
        return None
    role = _ROLE_INFO.format(group_rank), RoleInstanceInfo(spec.role, group_rank, spec.local_world_size).serialize()
    if group_rank == 0:
        return (*role, [_ROLE_INFO.format(rank) for rank in range(group_world_size)])
    return (*role, [_ASSIGNED_RANKS.format(group_rank)])


def torch_round_keys(nodes: int) -> list[str]:
    """The keys torch's agent writes in a round's store of ``nodes`` nodes: each node's role and
    assigned ranks (``SimpleElasticAgent._assign_worker_ranks``), the bootstrap store's address."""
    per_node = (_ROLE_INFO, _ASSIGNED_RANKS)
    return ([name.format(rank) for rank in range(nodes) for name in per_node]
            + [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY])


def executor_parts(handler: DynamicRendezvousHandler) -> tuple[NodeDesc, Any, RendezvousSettings]:
    """What torch's operation executor is made of: the handler's node, state holder and settings."""
    return handler._this_node, handler._state_holder, handler._settings


def set_op_executor(handler: DynamicRendezvousHandler, executor: DistributedRendezvousOpExecutor, *,
                    cache_s: float) -> None:
    """Run ``handler``'s operations through ``executor``; its state holder serves a cached state
    for at most ``cache_s`` seconds (torch's: 1 s)."""
    handler._op_executor = executor
    handler._state_holder._cache_duration = cache_s


@contextlib.contextmanager
def synced_state(handler: DynamicRendezvousHandler) -> Iterator[Any]:
    """Within: ``handler``'s state holder, synced with the backend, held against the handler's
    keep-alive thread (which syncs the same holder)."""
    with handler._heartbeat_lock:
        holder = handler._state_holder
        holder.sync()
        yield holder


def round_participants(handler: DynamicRendezvousHandler) -> frozenset[str]:
    """The participants of the round in ``handler``'s state as last synced (by its rendezvous, say)."""
    return frozenset(str(node) for node in handler._state_holder.state.participants)


def state_backend(handler: DynamicRendezvousHandler) -> Any:
    """The RendezvousBackend ``handler`` keeps its state in (c10d's, etcd3's)."""
    return handler._state_holder._backend


def set_state_backend(handler: DynamicRendezvousHandler, backend: Any) -> None:
    """Make ``handler``'s state holder keep its state in ``backend``: the holder ``pickle.loads``
    whatever bytes its backend returns."""
    handler._state_holder._backend = backend


def wrap_state_cleanup(handler: DynamicRendezvousHandler, wrap: Callable[[Any, Callable[[], None]], Callable[[], None]]) -> None:
    """Replace the clean-up torch's state holder runs after every sync (it drops nodes whose
    heartbeats lapsed) by ``wrap(holder, cleanup)``, which calls ``cleanup`` when it will."""
    holder = handler._state_holder
    holder._sanitize = wrap(holder, holder._sanitize)


def unsanitized_state(holder: Any) -> RendezvousState:
    """The state a holder just read, before its clean-up (inside a :func:`wrap_state_cleanup`)."""
    return holder._state


def nodes_dropped_by_cleanup(holder: Any) -> list[NodeDesc]:
    """The nodes the holder's last clean-up dropped (empty before any)."""
    return list(getattr(holder, "_dead_nodes", []))


def forget_dropped_nodes(holder: Any) -> None:
    """Clear the holder's record of dropped nodes (a wrapper may skip the clean-up that resets it)."""
    holder._dead_nodes = []


def registered_rendezvous_backends() -> set[str]:
    """The names torch's rendezvous handler registry knows."""
    return set(rendezvous_handler_registry._registry)


def bind_shared_store(handler: DynamicRendezvousHandler, make_store: Callable[[str], Any]) -> None:
    """Make ``handler``'s shared TCPStore server (hosted by the round's rank-0 agent) with
    ``make_store(address)``: torch's listens on every interface whatever address it is given."""
    handler._create_tcp_store_server = lambda master_addr, master_port: make_store(master_addr)


def hosts_c10d_store(host: str) -> bool:
    """Whether this node hosts the c10d backend's store when ``is_host`` is not given: the
    endpoint's host is this machine. torch asks only whether it is the hostname or an address the
    hostname resolves to; an address of this machine's interfaces that the hostname does not name
    (a second NIC, a network namespace of its own) is also here."""
    return _matches_machine_hostname(host) or _is_local_address(host)


def _is_local_address(host: str) -> bool:
    """Whether ``host`` resolves to an address of this machine's (network namespace's)
    interfaces: a socket binds to it (the kernel refuses a foreign address)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind((address[0], 0, *address[2:]))
            except OSError:
                continue
            return True
    return False


def is_strided_shard(placement: Any) -> bool:
    """Whether ``placement`` is DTensor's ``_StridedShard``: FSDP2 over tensor parallelism shards a
    dimension the TP mesh dimension shards already, right to left. torch's own offset computation
    (``compute_local_shape_and_global_offset``, which DCP uses too) gives such a shard's box."""
    from torch.distributed.tensor.placement_types import _StridedShard  # not while the rendezvous imports

    return isinstance(placement, _StridedShard)


def abort_process_group() -> None:
    """Abort every process group of this process and forget the default one (NCCL: a collective
    blocked on a peer that left returns with an error; from any thread)."""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group()


def forget_failed_group_init() -> None:
    """Undo what a failed ``init_process_group`` leaves behind in this process: torch names
    unnamed groups by a counter it advances before the backend connects, so after a failed init
    the process's next default group is "1" where its peers' (new processes, or ones whose init
    succeeded and whose group was destroyed) is "0", and gloo waits for keys that never come."""
    from torch.distributed import distributed_c10d

    distributed_c10d._world.group_count = 0


def forget_device_meshes() -> None:
    """Drop DTensor's caches of what it computed for a DeviceMesh. They are keyed by mesh
    equality, and a mesh compares equal to an older round's of the same shape, though this
    process's coordinate in it (its rank) may have changed since: a cache hit would hand a new
    round's DTensors the old mesh, and with it the shard offsets of the rank this process was."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def compile_stats() -> dict[str, float | int]:
    """torch.compile in this process so far (dynamo's own timers and counters): ``compile_s``
    (seconds compiling), ``cache_hits`` and ``cache_misses`` of inductor's FX graph cache (a miss:
    a graph compiled from scratch). All 0 while torch._dynamo is not imported."""
    if "torch._dynamo" not in sys.modules:
        return {"compile_s": 0.0, "cache_hits": 0, "cache_misses": 0}
    from torch._dynamo.utils import compile_times, counters

    names, values = compile_times(repr="csv", aggregate=True)
    seconds = sum(float(v) for name, v in zip(names, values) if name == "_compile.compile_inner")
    inductor = counters["inductor"]
    return {"compile_s": seconds, "cache_hits": int(inductor["fxgraph_cache_hit"]),
            "cache_misses": int(inductor["fxgraph_cache_miss"])}


def graphs_compiled() -> int:
    """How many graphs torch.compile (dynamo) has compiled in this process (its own counter; 0
    while torch._dynamo is not imported)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
