"""A joining node's rehearsal: with in-process rounds (``elastic.in_process``), a node that joins a
running job starts its workers before it asks to join. They run in a round of this node alone
(``TORCHREVIVE_ROUND`` = :data:`~agent.worker.REHEARSAL_ROUND`): the training script's imports and
set-up, and the warm-up it gives ``agent.run_resilient`` (its model built, sharded and compiled
on a step of synthetic data). Then they leave that round as survivors leave one and wait, and
the node asks to join. The job trains on meanwhile; when the round with this node forms, its
workers are handed that round in-process, with their compiled code, as the survivors are, so the
job no longer waits for a new node's process start and compile.
"""

from __future__ import annotations

import time
from pathlib import Path

from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from agent import regroup, torch_private
from agent.worker import REHEARSAL_ROUND

LOOPBACK = "127.0.0.1"
"""Where a rehearsal's store listens: it serves this node's own workers alone."""


def joins_a_running_job(handler: object) -> bool:
    """Whether the rendezvous shows a round under way that this node (yet to join) is not in."""
    if not isinstance(handler, DynamicRendezvousHandler):
        return False
    try:
        with torch_private.synced_state(handler) as holder:
            state = holder.state
            return bool(state.complete and not state.closed and state.participants)
    except RendezvousError:  # unreachable: the rendezvous itself tells
        return False


def rehearsal_workers(group: WorkerGroup, nproc_per_node: int, master_addr: str, master_port: int) -> None:
    """Give ``group`` the rehearsal's world: this node's local ranks alone, their process group on
    the store at ``master_addr:master_port``."""
    group.workers = [Worker(local_rank=rank, global_rank=rank, role_rank=rank, world_size=nproc_per_node,
                            role_world_size=nproc_per_node) for rank in range(nproc_per_node)]
    group.group_rank, group.group_world_size = 0, 1
    group.master_addr, group.master_port = master_addr, master_port


def wait_rehearsed(directory: Path, local_ranks: list[int], workers: PContext, deadline_s: float) -> str:
    """Wait until every local rank left the rehearsal: "" when all did, else why not."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if len(regroup.left_round(directory, local_ranks, REHEARSAL_ROUND)) == len(local_ranks):
            return ""
        ended = workers.wait(0)
        if ended is not None:
            how = ", ".join(f"local rank {f.local_rank} exit code {f.exitcode}" for f in ended.failures.values())
            return f"a worker process ended in the rehearsal ({how or 'exit code 0'})"
        time.sleep(0.05)
    return f"the rehearsal took longer than elastic.rehearsal_deadline ({deadline_s:g} s)"
