"""The private parts of torch.distributed.elastic that the recovery agent's health check, store
binding, warm workers and etcd3 heartbeat keys reach into, in one place. Each was read in torch 2.13; another
torch warns once, at import, because these names may have changed there (the tests then tell what
broke).
"""

from __future__ import annotations

import contextlib
import socket
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import api as multiprocessing_api
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

READ_IN = (2, 13)
"""The torch (major, minor) whose private code this module was written against."""


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
    original = multiprocessing_api.get_subprocess_handler
    multiprocessing_api.get_subprocess_handler = factory
    try:
        yield
    finally:
        multiprocessing_api.get_subprocess_handler = original


def this_node(handler: DynamicRendezvousHandler) -> str:
    """The handler's node as torch names it in the rendezvous state (``addr_pid_localid``)."""
    return repr(handler._this_node)


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
