"""loader.bind_cores: a rank's training process and its loader workers never share a core."""

from __future__ import annotations

import os

import pytest
import torch

from launcher.rank.data.affinity import BindWorker, core_list, split_cores


def test_ranks_get_disjoint_blocks_and_the_training_process_keeps_its_cores():
    cores = list(range(128))
    splits = [split_cores(cores, r, 8, workers=14) for r in range(8)]
    for r, s in enumerate(splits):
        assert s.main == (16 * r, 16 * r + 1)  # 2 cores: the training thread, the pin-memory thread
        assert s.workers == tuple(range(16 * r + 2, 16 * r + 16))
    every = [c for s in splits for c in s.main + s.workers]
    assert sorted(every) == cores, "each core belongs to exactly one rank"


def test_an_allocation_with_holes_is_split_in_core_order():
    s = split_cores([9, 3, 4, 10, 5, 11], local_rank=1, nproc=2, workers=2)
    assert (s.main, s.workers) == ((9,), (10, 11))


@pytest.mark.parametrize(
    "cores,nproc,workers", [(range(16), 1, 0), (range(2), 2, 1), (range(16), 16, 4)]
)
def test_nothing_to_split_leaves_the_process_alone(cores, nproc, workers):
    assert split_cores(list(cores), 0, nproc, workers) is None


def test_more_workers_than_cores_still_leave_the_training_process_one():
    s = split_cores(list(range(4)), 0, 1, workers=16)
    assert s.main == (0,) and s.workers == (1, 2, 3)


class _Affinity(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.tensor(sorted(os.sched_getaffinity(0)))


def test_a_loader_worker_runs_on_the_workers_cores_only():
    last = max(os.sched_getaffinity(0))
    loader = torch.utils.data.DataLoader(_Affinity(), num_workers=1, worker_init_fn=BindWorker([last]), batch_size=None)
    assert [t.tolist() for t in loader] == [[last], [last]]


def test_the_log_names_core_sets_in_cpuset_notation():
    assert core_list((0, 1, 2, 3)) == "0-3"
    assert core_list((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert core_list((4,)) == "4"
