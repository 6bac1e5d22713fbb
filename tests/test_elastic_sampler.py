"""ElasticSampler: property tests over dataset sizes, world sizes N -> M, interruption points
(within an epoch and at its boundary) and drop_last, against the uninterrupted run."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from agent.elastic_sampler import ElasticSampler, batches_across_epochs

MICRO = 2


def run_steps(state: dict | None, world: int, steps: int, *, n: int, global_batch: int, drop_last: bool,
              seed: int = 7) -> tuple[list[Counter], dict]:
    """Every rank of a world of ``world`` ranks trains ``steps`` optimizer steps from ``state``;
    returns each step's global batch (as a multiset) and the state after."""
    samplers = [ElasticSampler(n, global_batch_size=global_batch, micro_batch_size=MICRO, rank=r, world_size=world,
                               seed=seed, drop_last=drop_last) for r in range(world)]
    if state is not None:
        for sampler in samplers:
            sampler.load_state_dict(state)
    per_step = []
    for _ in range(steps):
        batch: Counter = Counter()
        for sampler in samplers:
            per_rank = sampler.grad_accum_steps * MICRO
            iterator = iter(sampler)
            batch.update(next(iterator) for _ in range(per_rank))
        per_step.append(batch)
        for sampler in samplers:
            sampler.advance()
    states = {str(s.state_dict()) for s in samplers}
    assert len(states) == 1  # every rank holds the same position
    return per_step, samplers[0].state_dict()


world_sizes = st.sampled_from([1, 2, 3, 4, 6])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 80), worlds=st.tuples(world_sizes, world_sizes), multiple=st.integers(1, 3),
       data=st.data(), drop_last=st.booleans())
def test_a_resume_at_another_world_size_sees_the_same_global_batches(n, worlds, multiple, data, drop_last):
    before, after = worlds
    global_batch = MICRO * 12 * multiple  # a multiple of MICRO x every world size drawn
    if drop_last and n < global_batch:
        n = global_batch
    steps_per_epoch = ElasticSampler(n, global_batch_size=global_batch, micro_batch_size=MICRO, rank=0, world_size=1,
                                     drop_last=drop_last).steps_per_epoch
    total = 2 * steps_per_epoch + 1  # across an epoch boundary
    cut = data.draw(st.integers(0, total), label="interrupted after step")
    reference, _ = run_steps(None, before, total, n=n, global_batch=global_batch, drop_last=drop_last)
    first, state = run_steps(None, before, cut, n=n, global_batch=global_batch, drop_last=drop_last)
    second, _ = run_steps(state, after, total - cut, n=n, global_batch=global_batch, drop_last=drop_last)
    assert first + second == reference
    # Every sample exactly once per epoch (drop_last drops the same tail every time; without it the
    # last batch is completed from the start of the epoch's order).
    epoch = sum(reference[:steps_per_epoch], Counter())
    if drop_last:
        assert set(epoch.values()) == {1} and len(epoch) == steps_per_epoch * global_batch
    else:
        assert set(range(n)) == set(epoch) and sum(epoch.values()) == steps_per_epoch * global_batch


def test_a_global_batch_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"global_batch_size 10 must be a positive multiple of micro_batch_size 2 x "
                                         r"world size 3 = 6"):
        ElasticSampler(100, global_batch_size=10, micro_batch_size=2, rank=0, world_size=3)


def test_state_from_another_order_is_refused():
    sampler = ElasticSampler(100, global_batch_size=8, micro_batch_size=2, rank=0, world_size=2, seed=1)
    other = ElasticSampler(100, global_batch_size=8, micro_batch_size=2, rank=0, world_size=2, seed=2)
    with pytest.raises(ValueError, match="state has seed=1 but this sampler 2"):
        other.load_state_dict(sampler.state_dict())


def test_with_a_multi_worker_dataloader():
    dataset = TensorDataset(torch.arange(40))
    sampler = ElasticSampler(40, global_batch_size=8, micro_batch_size=2, rank=1, world_size=2, seed=3)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2)
    seen = [int(i) for (batch,) in loader for i in batch]
    order = sampler.order(0).tolist()
    expected = [i for step in range(5) for k in range(2) for i in order[step * 8 + (k * 2 + 1) * 2: step * 8 + (k * 2 + 1) * 2 + 2]]
    assert seen == expected and len(seen) == len(sampler) == 20


def test_batches_across_epochs_follow_the_sampler_into_each_next_epoch_from_a_restored_position():
    # 5 samples, 2 a step: 3 steps an epoch (the last completed from the epoch's start). The batches
    # are made before the restore that sets the position: they are read from it, not from step 0.
    sampler = ElasticSampler(5, global_batch_size=2, micro_batch_size=2, rank=0, world_size=1, seed=1)
    batches = batches_across_epochs(DataLoader(TensorDataset(torch.arange(5)), batch_size=2, sampler=sampler))
    sampler.load_state_dict({**sampler.state_dict(), "consumed": 2})
    seen = []
    for _ in range(7):
        (batch,) = next(batches)
        seen.append(batch.tolist())
        sampler.advance()
    orders = [sampler.order(epoch).tolist() for epoch in range(3)]
    assert seen == [orders[0][2:4], orders[0][4:6], *(orders[e][i:i + 2] for e in (1, 2) for i in (0, 2, 4))][:7]
    assert sampler.epoch == 2 and orders[0] != orders[1]


def test_batches_across_epochs_of_an_empty_loader_fail_at_once():
    with pytest.raises(ValueError, match="yields no batch"):
        next(batches_across_epochs([]))
