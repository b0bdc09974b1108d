"""Each rank's batches: disjoint shards that cover the data, a new order every epoch, exact resume."""

from __future__ import annotations

import random

import numpy as np

from launcher.rank.data.sampler import EpochBatchSampler, EpochSeededDataset, epoch_indices, mosaic_closes_at


def take(sampler: EpochBatchSampler, n_batches: int) -> list[list[tuple[int, int]]]:
    it = iter(sampler)
    return [next(it) for _ in range(n_batches)]


def test_shards_of_an_epoch_are_disjoint_and_cover_the_dataset():
    for epoch in range(3):
        shards = [set(epoch_indices(100, epoch, num_replicas=4, rank=r, seed=7)) for r in range(4)]
        assert set().union(*shards) == set(range(100))
        assert sum(len(s) for s in shards) == 100


def test_every_epoch_has_a_new_order_from_the_first_one_on():
    orders = [epoch_indices(64, e, num_replicas=1, rank=0, seed=0) for e in range(4)]
    assert len({tuple(o) for o in orders}) == 4  # Ultralytics' loader repeats epoch 0's order in epoch 1


def test_batches_carry_their_epoch_and_cross_epochs_without_mixing():
    s = EpochBatchSampler(10, 4, num_replicas=1, rank=0, seed=0)
    assert s.batches_per_epoch == 3
    batches = take(s, 6)
    assert [{e for e, _ in b} for b in batches] == [{0}, {0}, {0}, {1}, {1}, {1}]
    assert sorted(i for b in batches[:3] for _, i in b) == list(range(10))


def test_starting_mid_run_gives_exactly_the_batches_an_uninterrupted_run_gets():
    full = take(EpochBatchSampler(50, 8, num_replicas=2, rank=1, seed=3), 12)
    resumed = EpochBatchSampler(50, 8, num_replicas=2, rank=1, seed=3)
    resumed.start_at(epoch=2, batch=1)  # 4 batches per epoch: batch 9 of the run
    assert take(resumed, 3) == full[9:12]


def test_a_filled_epoch_has_full_batches_ending_with_its_first_images_and_resumes_exactly():
    """train.cuda_graphs: the short last batch (10 images in 4s: 2) completed from the epoch's own order, so that every
    step replays the graph; every image still trained once before any repeats, each epoch its own order."""
    s = EpochBatchSampler(10, 4, num_replicas=1, rank=0, seed=0, fill_last=True)
    assert s.batches_per_epoch == 3 and s.filled == 2
    batches = take(s, 8)
    assert [len(b) for b in batches] == [4] * 8
    for epoch in 0, 1:
        order = [i for b in batches[3 * epoch: 3 * epoch + 3] for e, i in b if e == epoch]
        assert sorted(order[:10]) == list(range(10)) and order[10:] == order[:2]
    assert batches[0] != batches[3]
    resumed = EpochBatchSampler(10, 4, num_replicas=1, rank=0, seed=0, fill_last=True)
    resumed.start_at(epoch=1, batch=2)
    assert take(resumed, 3) == batches[5:8]
    # a shard smaller than a batch cycles; a shard the batch divides is left as it is
    tiny = take(EpochBatchSampler(3, 8, num_replicas=2, rank=1, seed=1, fill_last=True), 1)[0]
    assert len(tiny) == 8 and len({i for _, i in tiny}) == 2
    assert EpochBatchSampler(16, 4, num_replicas=2, fill_last=True).filled == 0
    assert EpochBatchSampler(10, 4).filled == 0


class _Draw:
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return (i, random.random(), float(np.random.rand()))


def test_augmentation_randomness_depends_on_seed_epoch_and_index_only():
    ds = EpochSeededDataset(_Draw(), seed=1)
    a = ds[(0, 3)]
    random.seed(999)  # whatever ran before in this worker
    np.random.seed(5)
    assert ds[(0, 3)] == a
    assert ds[(1, 3)] != a and EpochSeededDataset(_Draw(), seed=2)[(0, 3)] != a


def test_from_close_mosaic_epoch_on_samples_come_from_the_closed_dataset():
    """The workers hold both datasets: a batch prefetched across the boundary is loaded as its own epoch wants."""
    class Named(_Draw):
        def __init__(self, name):
            self.name = name

        def __getitem__(self, i):
            return self.name

    ds = EpochSeededDataset(Named("mosaic"), seed=0, closed=Named("closed"), close_at=3)
    assert [ds[(e, 0)] for e in range(5)] == ["mosaic"] * 3 + ["closed"] * 2


def test_mosaic_closes_for_the_last_epochs_as_in_ultralytics_and_never_in_a_shorter_run():
    assert mosaic_closes_at(10, 5) == 5 and mosaic_closes_at(5, 5) == 0
    assert mosaic_closes_at(1, 5) is None and mosaic_closes_at(10, 0) is None  # Ultralytics: epoch == epochs - close
