"""ElasticSampler: every sample exactly once per epoch, in the same global order, whatever the world
size, across restarts that change it.

The state is a position in a global, seeded permutation of the dataset (epoch, samples consumed),
never a per-rank index. Each optimizer step consumes the next ``global_batch_size`` samples of the
permutation; a rank's share of a step is ``grad_accum_steps`` micro-batches of
``micro_batch_size``, taken from that same global batch. So after a resume at another world
size, each optimizer step sees exactly the samples it would have seen without the interruption.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils.data import Sampler

T = TypeVar("T")


class ElasticSampler(Sampler[int]):
    """Yields this rank's sample indices, micro-batch after micro-batch, from the current position.

    Args:
        dataset_len: number of samples.
        global_batch_size: samples per optimizer step, across all ranks (kept across world sizes).
        micro_batch_size: samples per rank per forward/backward pass; the gradient accumulation
            steps are ``global_batch_size / (micro_batch_size * world_size)`` (see
            :attr:`grad_accum_steps`).
        rank, world_size: this rank and the world (default: the initialized process group, else
            0 of 1).
        seed: seeds the permutation of each epoch (``seed + epoch``).
        shuffle: permute (True) or keep the dataset order.
        drop_last: drop the epoch's last, partial global batch (True), or complete it with samples
            from the start of the epoch's order (False), as DistributedSampler pads.

    Call :meth:`advance` after each optimizer step; ``state_dict`` / ``load_state_dict`` make the
    sampler a Stateful for ``app_state``. Use it with ``DataLoader(batch_size=micro_batch_size)``.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if rank is None or world_size is None:
            import torch.distributed as dist

            initialized = dist.is_available() and dist.is_initialized()
            rank = dist.get_rank() if initialized else 0
            world_size = dist.get_world_size() if initialized else 1
        per_pass = micro_batch_size * world_size
        if dataset_len < 1 or micro_batch_size < 1 or global_batch_size < per_pass or global_batch_size % per_pass:
            raise ValueError(
                f"global_batch_size {global_batch_size} must be a positive multiple of micro_batch_size "
                f"{micro_batch_size} x world size {world_size} = {per_pass} (and the dataset non-empty): pick a "
                "micro batch that divides global_batch_size / world size")
        if drop_last and dataset_len < global_batch_size:
            raise ValueError(f"drop_last with {dataset_len} samples < global_batch_size {global_batch_size} "
                             "leaves no step in an epoch")
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self.consumed = 0
        """samples of the current epoch consumed by completed optimizer steps"""

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.dataset_len, self.global_batch_size)
        return full if self.drop_last or not rest else full + 1

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's global order of samples, completed to whole global batches."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_len, generator=generator)
        else:
            order = torch.arange(self.dataset_len)
        length = self.steps_per_epoch * self.global_batch_size
        if length > self.dataset_len:
            order = order.repeat(-(-length // self.dataset_len))
        return order[:length]

    def __iter__(self) -> Iterator[int]:
        """This rank's indices from the current position to the end of the epoch: per step, its
        ``grad_accum_steps`` micro-batches, micro-batch k of rank r at offset (k x world + r) x micro."""
        order = self.order(self.epoch)
        micro, world = self.micro_batch_size, self.world_size
        for start in range(self.consumed, len(order), self.global_batch_size):
            for k in range(self.grad_accum_steps):
                offset = start + (k * world + self.rank) * micro
                yield from order[offset : offset + micro].tolist()

    def __len__(self) -> int:
        remaining_steps = self.steps_per_epoch - self.consumed // self.global_batch_size
        return remaining_steps * self.grad_accum_steps * self.micro_batch_size

    def advance(self, steps: int = 1) -> None:
        """Record ``steps`` completed optimizer steps (rolls over into the next epoch)."""
        self.consumed += steps * self.global_batch_size
        epoch_len = self.steps_per_epoch * self.global_batch_size
        while self.consumed >= epoch_len:
            self.consumed -= epoch_len
            self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "dataset_len": self.dataset_len,
                "global_batch_size": self.global_batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position; the order must be the same (dataset, seed, global batch)."""
        for key in ("seed", "dataset_len", "global_batch_size", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(f"ElasticSampler state has {key}={state[key]!r} but this sampler {getattr(self, key)!r}: "
                                 "the resumed run would see another order of samples; construct it the same way")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def batches_across_epochs(loader: Iterable[T]) -> Iterator[T]:
    """``loader``'s batches without end: iterated again each time an epoch ends, when its
    ElasticSampler (advanced after every step) has moved on to the next epoch's order. Iterated
    first at the first ``next``, so create it after a restore has set the sampler's position."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the loader yields no batch: an ElasticSampler's dataset must hold at least one sample")
