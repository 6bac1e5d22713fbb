"""The timeouts that bound a recovery, their defaults, and the rules between them, in one place.

A recovery is bounded by a chain of timeouts set in different places: torch's rendezvous
(``keep_alive_interval`` x ``keep_alive_max_attempt`` finds a hung node, ``last_call_timeout``
waits for more nodes, ``join_timeout`` is how long a node waits to be let in), the agent
(``elastic.join_wait`` defers a join to the next commit, ``elastic.stop_grace`` and
``elastic.in_process_deadline`` end a round's workers), the workers' process groups
(``elastic.process_group_timeout``: how long a collective waits for a silent peer) and the etcd3
backend's lease (``lease_ttl``). In the wrong order a recovery takes minutes or never happens:
a collective that times out before the agent has found its hung peer fails the survivors, and a
node whose join is deferred past its ``join_timeout`` gives up. :class:`RecoveryTimeouts` holds
the resolved values and says which rules a set of them breaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TORCH_RENDEZVOUS_DEFAULTS_S = {
    "join_timeout": 600.0,
    "last_call_timeout": 30.0,
    "heartbeat_timeout": 5.0,
    "keep_alive_interval": 5.0,
}
"""torch.distributed.elastic's dynamic rendezvous defaults, for the keys a recovery depends on."""
TORCH_KEEP_ALIVE_MAX_ATTEMPT = 3
DEFAULT_PROCESS_GROUP_TIMEOUT_S = 600.0
"""torch's own default for NCCL process groups (gloo's is 30 min): long enough for a slow rank's
first compiled step, short enough that a hang the agent cannot see still ends."""
DEFAULT_LEASE_TTL_S = 60
MAX_RETRY_DELAY_S = 2.0
"""The etcd3 client's longest wait between two retries of an unreachable cluster."""


def etcd_outage_grace_s(keep_alive_interval: float, keep_alive_max_attempt: int) -> float:
    """How long the etcd3 backend waits after an etcd outage before it drops nodes for lapsed
    heartbeats: one heartbeat timeout, a keep-alive period and the client's longest retry delay."""
    return keep_alive_interval * (keep_alive_max_attempt + 1) + MAX_RETRY_DELAY_S


def default_lease_ttl_s(keep_alive_interval: float, keep_alive_max_attempt: int) -> int:
    """The etcd3 lease of a run's keys: 60 s, or longer than an outage the agents ride out."""
    grace = etcd_outage_grace_s(keep_alive_interval, keep_alive_max_attempt)
    return max(DEFAULT_LEASE_TTL_S, math.ceil(grace + keep_alive_interval))


def derived_join_wait_s(join_timeout: float, last_call_timeout: float) -> float:
    """``elastic.join_wait`` when the job does not set it: half of what ``join_timeout`` leaves
    after a last call, so that a deferred node is let in well before it gives up (285 s with
    torch's defaults)."""
    return max(0.0, (join_timeout - last_call_timeout) / 2)


DEFAULT_JOIN_WAIT_S = derived_join_wait_s(TORCH_RENDEZVOUS_DEFAULTS_S["join_timeout"],
                                          TORCH_RENDEZVOUS_DEFAULTS_S["last_call_timeout"])


def derived_process_group_timeout_s(detection_s: float, stop_grace: float) -> float:
    """``elastic.process_group_timeout`` when the job does not set it: 600 s, or twice what the
    agent needs to find a hung peer and stop the workers waiting on it."""
    return max(DEFAULT_PROCESS_GROUP_TIMEOUT_S, 2 * (detection_s + stop_grace))


@dataclass(frozen=True)
class Timeout:
    """One line of the chain: a config key, its value, and what it bounds."""

    key: str
    seconds: float
    bounds: str


@dataclass(frozen=True)
class RuleBreak:
    """Two keys in the wrong order: ``keys`` (the first is the one to change), and the problem
    and its fix in one sentence."""

    keys: tuple[str, str]
    problem: str


@dataclass(frozen=True, kw_only=True)
class RecoveryTimeouts:
    """The resolved timeouts of one job (seconds). ``lease_ttl`` is None off the etcd3 backend;
    ``grows`` says whether the job admits more nodes than its minimum (nnodes MIN:MAX, MIN < MAX),
    the only case where a last call and a deferred join happen."""

    keep_alive_interval: float
    keep_alive_max_attempt: int
    heartbeat_timeout: float
    join_timeout: float
    last_call_timeout: float
    join_wait: float
    stop_grace: float
    in_process_deadline: float
    process_group_timeout: float
    lease_ttl: float | None
    grows: bool

    @property
    def detection_s(self) -> float:
        """How long a hung or cut-off node keeps its place: its heartbeats lapse after this."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    def chain(self) -> list[Timeout]:
        """Every timeout that matters to a recovery, in the order a recovery meets them."""
        conf = "rendezvous.conf."
        lines = [
            Timeout(f"{conf}keep_alive_interval x keep_alive_max_attempt", self.detection_s,
                    "finds a hung node (a dead agent is found at once, by its closed connections); "
                    "< elastic.process_group_timeout"),
            Timeout(f"{conf}heartbeat_timeout", self.heartbeat_timeout, "one heartbeat write to the rendezvous"),
            Timeout("elastic.stop_grace", self.stop_grace, "SIGTERM to SIGKILL when the agent stops a round's workers"),
            Timeout("elastic.in_process_deadline", self.in_process_deadline,
                    "survivors leave a round in-process within this, else they restart"),
            Timeout(f"{conf}last_call_timeout", self.last_call_timeout,
                    "waits for more nodes once the minimum joined; < join_timeout"),
            Timeout("elastic.join_wait", self.join_wait,
                    "defers a joining node to the next commit; join_wait + last_call_timeout < join_timeout"),
            Timeout(f"{conf}join_timeout", self.join_timeout, "how long a node waits to be let into a round"),
            Timeout("elastic.process_group_timeout", self.process_group_timeout,
                    "how long a collective waits for a silent peer; > hung-node detection + stop_grace"),
        ]
        if self.lease_ttl is not None:
            lines.append(Timeout(f"{conf}lease_ttl", self.lease_ttl,
                                 "etcd keeps a run's keys this long after its last agent; "
                                 "> the outage the agents ride out"))
        return lines

    def rule_breaks(self) -> list[RuleBreak]:
        """The rules this set breaks, each naming both keys and the fix."""
        conf = "rendezvous.conf."
        breaks = []
        if self.keep_alive_max_attempt < 2:
            breaks.append(RuleBreak(
                (f"{conf}keep_alive_max_attempt", f"{conf}keep_alive_interval"),
                f"keep_alive_max_attempt {self.keep_alive_max_attempt} drops a healthy node at its first late "
                f"heartbeat (a pause of keep_alive_interval {self.keep_alive_interval:g} s); use 2 or more"))
        if self.grows and self.join_timeout <= self.last_call_timeout:
            breaks.append(RuleBreak(
                (f"{conf}join_timeout", f"{conf}last_call_timeout"),
                f"join_timeout {self.join_timeout:g} s must exceed last_call_timeout {self.last_call_timeout:g} s, "
                "or nodes give up before a round of fewer than the maximum closes; raise join_timeout"))
        elif self.grows and self.join_wait + self.last_call_timeout >= self.join_timeout:
            breaks.append(RuleBreak(
                ("elastic.join_wait", f"{conf}join_timeout"),
                f"join_wait {self.join_wait:g} s + last_call_timeout {self.last_call_timeout:g} s must stay below "
                f"join_timeout {self.join_timeout:g} s, or a deferred node gives up before it is let in; "
                "lower elastic.join_wait or raise join_timeout"))
        least = self.detection_s + self.stop_grace
        if self.process_group_timeout <= least:
            breaks.append(RuleBreak(
                ("elastic.process_group_timeout", f"{conf}keep_alive_interval"),
                f"process_group_timeout {self.process_group_timeout:g} s must exceed hung-node detection "
                f"(keep_alive_interval x keep_alive_max_attempt = {self.detection_s:g} s) + stop_grace "
                f"{self.stop_grace:g} s, or collectives fail the survivors before the agent finds the hung node; "
                f"raise elastic.process_group_timeout above {least:g} s"))
        if self.lease_ttl is not None:
            grace = etcd_outage_grace_s(self.keep_alive_interval, self.keep_alive_max_attempt)
            if self.lease_ttl <= grace:
                breaks.append(RuleBreak(
                    (f"{conf}lease_ttl", f"{conf}keep_alive_interval"),
                    f"lease_ttl {self.lease_ttl:g} s must exceed the etcd outage the agents ride out "
                    f"({grace:g} s at this keep_alive_interval), or the run's keys expire during one; "
                    f"raise lease_ttl above {grace:g} s or leave it unset"))
        return breaks


def describe(timeouts: RecoveryTimeouts) -> str:
    """The chain as YAML comments, for ``--print-config``."""
    lines = ["# Timeouts that bound a recovery (seconds), in the order a recovery meets them:"]
    width = max(len(t.key) for t in timeouts.chain())
    lines += [f"#   {t.key:<{width}}  {t.seconds:>7g}  {t.bounds}" for t in timeouts.chain()]
    return "\n".join(lines) + "\n"
