"""A network of Linux network namespaces for the local cluster: one namespace a node, each with its
own address on one bridge in the root namespace, and link faults on a node's link (cut, heal, slow).

Addresses come from 198.18.0.0/15 (reserved for benchmarking networks): node i is 198.18.0.(i+1),
the bridge (the root namespace, where an etcd can listen) 198.18.0.254; /24 on a bridge of its own,
and no route out of the machine is added. Inside every namespace the node's end of its link has
the same name (``LINK``), so that one GLOO_SOCKET_IFNAME serves every node.

Names carry the creating process's id (``trn<pid>-<i>``, links ``trv<pid>-<i>``, bridge ``trb<pid>``): :func:`remove_leftovers`
deletes those of processes that no longer run (a crashed or SIGKILLed harness). Needs root and
the ``ip`` command (iproute2); :class:`NetnsError` says so otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

SUBNET_PREFIX = "198.18.0."
BRIDGE_ADDRESS = SUBNET_PREFIX + "254"
LINK = "trlink0"
"""The node's end of its link, inside its namespace."""
NAME = re.compile(r"^tr[nbv](\d+)(?:-(\d+))?$")


class NetnsError(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, a command failed)."""


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or drop --netns)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip()}"
    return None


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS`` (inside ``netns`` when given); NetnsError with its message when it fails."""
    command = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")
    return done


def tc(*args: str, netns: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``tc ARGS`` inside ``netns``."""
    command = ["ip", "netns", "exec", netns, "tc", *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete the namespaces and bridges of harness runs whose process is gone; their names."""
    removed = []
    namespaces = [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", "show").stdout.splitlines()]
    for name in namespaces + links:
        match = NAME.match(name)
        if match and not _alive(int(match.group(1))):
            ip(*(("netns", "del", name) if name in namespaces else ("link", "del", name)), check=False)
            removed.append(name)
    return removed


@dataclass
class Network:
    """``nodes`` namespaces on one bridge. Use as a context manager (removed on exit), or call
    :meth:`create` and :meth:`remove` (safe to call twice, and after a partial create)."""

    nodes: int
    owner: int = field(default_factory=os.getpid)
    shaped: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200:
            raise ValueError(f"nodes={self.nodes}: a network holds 1 to 200 nodes")

    @property
    def bridge(self) -> str:
        return f"trb{self.owner}"

    def namespace(self, index: int) -> str:
        return f"trn{self.owner}-{index}"

    def host_link(self, index: int) -> str:
        """The root namespace's end of node ``index``'s link (on the bridge)."""
        return f"trv{self.owner}-{index}"

    @staticmethod
    def address(index: int) -> str:
        return f"{SUBNET_PREFIX}{index + 1}"

    @property
    def addresses(self) -> list[str]:
        return [self.address(i) for i in range(self.nodes)]

    def create(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise NetnsError(reason)
        remove_leftovers()
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for index in range(self.nodes):
            self._add_node(index)

    def _add_node(self, index: int) -> None:
        ns, host = self.namespace(index), self.host_link(index)
        ip("netns", "add", ns)
        ip("link", "add", host, "type", "veth", "peer", "name", LINK, "netns", ns)
        ip("link", "set", host, "master", self.bridge)
        ip("link", "set", host, "up")
        ip("addr", "add", f"{self.address(index)}/24", "dev", LINK, netns=ns)
        ip("link", "set", LINK, "up", netns=ns)
        ip("link", "set", "lo", "up", netns=ns)

    def remove(self) -> None:
        """Delete every namespace (their links go with them) and the bridge; missing ones are fine."""
        for index in range(self.nodes):
            ip("netns", "del", self.namespace(index), check=False)
            ip("link", "del", self.host_link(index), check=False)  # some kernels keep it when its peer's namespace goes
        ip("link", "del", self.bridge, check=False)

    def wrap(self, index: int, command: list[str]) -> list[str]:
        """``command`` run inside node ``index``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespace(index), *command]

    # -- link faults ----------------------------------------------------------------------------

    def cut(self, index: int) -> None:
        """Partition node ``index``: its link goes down (no packet in or out, no reset sent)."""
        ip("link", "set", self.host_link(index), "down")

    def heal(self, index: int) -> None:
        ip("link", "set", self.host_link(index), "up")

    def slow(self, index: int, delay_ms: float, loss_pct: float) -> str:
        """Delay and drop node ``index``'s outgoing packets; returns what was applied. netem when
        the kernel has it; else (a kernel without sch_netem, nor the classifiers and actions a
        random drop needs, as this sandbox's) a token bucket whose queue delays bulk traffic by
        up to ``delay_ms``: no fixed per-packet delay, and no loss."""
        ns = self.namespace(index)
        done = tc("qdisc", "add", "dev", LINK, "root", "netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%",
                  netns=ns, check=False)
        if done.returncode == 0:
            self.shaped[index] = applied = f"netem delay {delay_ms}ms loss {loss_pct}%"
            return applied
        tc("qdisc", "add", "dev", LINK, "root", "tbf", "rate", "50mbit", "burst", "64kbit",
           "latency", f"{max(delay_ms, 1):.0f}ms", netns=ns)
        applied = f"tbf rate 50mbit latency {delay_ms:.0f}ms, no loss (this kernel has no netem)"
        self.shaped[index] = applied
        return applied

    def unslow(self, index: int) -> None:
        ns = self.namespace(index)
        tc("qdisc", "del", "dev", LINK, "root", netns=ns, check=False)
        self.shaped.pop(index, None)

    def __enter__(self) -> Network:
        try:
            self.create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
