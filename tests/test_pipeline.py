"""A rank's input pipeline (rank/data/pipeline.py): one loader iterator for the run, restarted only where it must
be, batches fetched during the step, and the loader's delay counted as that batch's data wait. Fake loader and
clock; the CPU path (on CUDA the fetched batch is copied on a side stream, tests/test_cuda_runs.py trains with it)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from launcher.rank.data.pipeline import MAX_TARGETS, TrainInputs, to_device


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeSampler:
    def __init__(self):
        self.starts = []

    def start_at(self, epoch: int, batch: int = 0) -> None:
        self.starts.append((epoch, batch))


class SlowLoader:
    """A DataLoader whose every batch keeps the host waiting `delay` seconds of the fake clock."""

    def __init__(self, clock: Clock, delay: float):
        self.clock, self.delay, self.iterators = clock, delay, 0

    def __iter__(self):
        self.iterators += 1
        return self._batches()

    def _batches(self):
        n = 0
        while True:
            self.clock.t += self.delay
            n += 1
            yield n


def inputs(clock, delay=0.3, **kw):
    loader, sampler = SlowLoader(clock, delay), FakeSampler()
    prepare = lambda raw, ni: {"raw": raw, "ni": ni}  # noqa: E731
    return TrainInputs(loader, sampler, torch.device("cpu"), prepare, clock=clock, **kw), loader, sampler


def test_a_batch_fetched_during_the_step_carries_the_loaders_delay_as_its_wait():
    clock = Clock()
    pipe, _, _ = inputs(clock, delay=0.3)
    pipe.begin_epoch(0, 0)
    first = pipe.next(0)
    assert first == {"raw": 1, "ni": 0} and pipe.last_wait == pytest.approx(0.3)
    pipe.prefetch(1)  # during step 0: the loader keeps the host 0.3 s...
    clock.t += 5.0  # ...and the step runs on
    second = pipe.next(1)
    assert second == {"raw": 2, "ni": 1} and pipe.last_wait == pytest.approx(0.3)  # ready at once, waited for before


def test_without_fetch_ahead_nothing_is_fetched_during_the_step():
    clock = Clock()
    pipe, _, _ = inputs(clock, fetch_ahead=False)
    pipe.begin_epoch(0, 0)
    pipe.next(0)
    pipe.prefetch(1)
    assert pipe.next(1) == {"raw": 2, "ni": 1}


def test_one_iterator_serves_the_run_unless_workers_are_not_persistent():
    clock = Clock()
    pipe, loader, sampler = inputs(clock)
    for epoch in range(4):  # close_mosaic's epoch too: the dataset closes mosaic by each batch's epoch
        pipe.begin_epoch(epoch, 2 if epoch == 0 else 0)
    assert loader.iterators == 1 and sampler.starts == [(0, 2)]  # resumed at step 2; later epochs run on
    transient, loader, sampler = inputs(clock, persistent=False)
    for epoch in range(3):
        transient.begin_epoch(epoch, 0)
    assert loader.iterators == 3 and sampler.starts == [(0, 0), (1, 0), (2, 0)]


def test_a_batch_reaches_the_step_scaled_with_its_largest_per_image_target_count():
    batch = {"img": torch.full((3, 3, 8, 8), 255, dtype=torch.uint8), "batch_idx": torch.tensor([0.0, 2, 2])}
    out = to_device(batch, torch.device("cpu"), imgsz=8, stride=8)
    assert out["img"].dtype == torch.float32 and float(out["img"].max()) == 1.0
    assert out[MAX_TARGETS] == 2  # counted on the host, before the labels moved


def decode_in_its_thread(raw):
    assert threading.current_thread().name == "input-decode"  # the loop's thread and the preparing one never wait
    return raw * 10


@pytest.mark.parametrize("decode", [None, decode_in_its_thread])
def test_the_background_threads_prepare_the_steps_in_order_across_epochs_and_new_workers(decode):
    """loader.augment_on=gpu: threads prepare batch ni, ni + 1, ... ahead of the loop (with `decode`, one decodes,
    the other prepares what it decoded); new workers (loader.persistent_workers=false starts them at every epoch)
    drop what the old ones prepared and count from the step the loop is at."""
    pipe, loader, sampler = inputs(Clock(), background=True, decode=decode)
    k = 10 if decode else 1
    pipe.begin_epoch(0, 0, first_ni=0)
    got = [pipe.next(ni) for ni in range(5)]
    pipe.prefetch(5)  # a no-op: the thread is ahead already
    assert [b["ni"] for b in got] == list(range(5)) and [b["raw"] for b in got] == [k, 2 * k, 3 * k, 4 * k, 5 * k]
    pipe.begin_epoch(1, 0, first_ni=5)  # persistent: the same threads and iterator run on
    assert pipe.next(5)["raw"] == 6 * k and loader.iterators == 1
    pipe.close()
    pipe.begin_epoch(2, 0, first_ni=12)
    assert loader.iterators == 2 and pipe.next(12) == {"raw": k, "ni": 12}
    with pytest.raises(RuntimeError, match="prepared batch 13, the loop asked for 14"):
        pipe.next(14)
    pipe.close()
    pipe.begin_epoch(3, 0, first_ni=20)
    pipe.next(20)
    held = pipe.batches_on_device(2, first_ni=0)  # ddp-bench's ceiling after its loop: the steps that come next
    assert [b["ni"] for b in held] == [21, 22] and pipe._worker is None


@pytest.mark.parametrize("fails_in", ["prepare", "decode"])
def test_a_failure_in_the_background_threads_reaches_the_loop(fails_in):
    def prepare(raw, ni):
        if fails_in == "prepare" and ni == 2:
            raise ValueError("a damaged batch")
        return {"ni": ni}

    def decode(raw):
        if fails_in == "decode" and raw == 3:  # the loader's third batch: step 2's
            raise ValueError("a damaged batch")
        return raw

    pipe = TrainInputs(SlowLoader(Clock(), 0.0), FakeSampler(), torch.device("cpu"), prepare, decode=decode,
                       background=True)
    pipe.begin_epoch(0, 0, first_ni=0)
    assert pipe.next(0) == {"ni": 0} and pipe.next(1) == {"ni": 1}
    with pytest.raises(RuntimeError, match="preparing a training batch failed") as raised:
        pipe.next(2)
    assert isinstance(raised.value.__cause__, ValueError)
    pipe.close()
    assert not any(thread.is_alive() for thread in threading.enumerate() if thread.name.startswith("input-"))


def test_stopping_returns_while_the_decode_thread_waits_for_the_loader():
    class Stuck:
        def __iter__(self):
            yield 1
            time.sleep(0.5)  # the loader's workers, slow to hand over the next batch
            yield 2

    pipe = TrainInputs(Stuck(), FakeSampler(), torch.device("cpu"), lambda raw, ni: {"raw": raw}, decode=lambda r: r,
                       background=True)
    pipe.begin_epoch(0, 0, first_ni=0)
    assert pipe.next(0) == {"raw": 1}
    pipe.close()  # the preparing thread waits for the decode thread, which waits for the loader
    assert not any(thread.is_alive() for thread in threading.enumerate() if thread.name.startswith("input-"))


def test_each_input_thread_says_where_its_time_went_across_iterators():
    """The background threads' time (TrainInputs.thread_times): a decode that takes 30 ms a batch keeps the
    augmenting thread, which works 5 ms, waiting; both count the batches they handed on, over two iterators
    (loader.persistent_workers=false), and what the loop did not take in time shows as time blocked ahead."""

    def decode(raw):
        time.sleep(0.03)
        return raw

    def prepare(raw, ni):
        time.sleep(0.005)
        return {"ni": ni}

    pipe = TrainInputs(SlowLoader(Clock(), 0.0), FakeSampler(), torch.device("cpu"), prepare, decode=decode,
                       background=True, persistent=False)
    assert pipe.thread_times() == {}  # no threads yet
    pipe.begin_epoch(0, 0, first_ni=0)
    for ni in range(6):
        pipe.next(ni)
    time.sleep(0.5)  # the loop is slow now: the threads fill their queues (6 decodes: 0.18 s), then wait, done
    pipe.begin_epoch(1, 0, first_ni=6)  # a new iterator: the old threads' time is kept
    for ni in range(6, 10):
        pipe.next(ni)
    times = pipe.thread_times()
    pipe.close()
    decoding, augmenting = times["decode"].per_batch_ms(), times["prepare"].per_batch_ms()
    assert times["prepare"].batches >= 10 and times["decode"].batches >= times["prepare"].batches
    assert decoding["working_ms"] >= 30 and augmenting["working_ms"] >= 5
    assert augmenting["waiting_ms"] > augmenting["working_ms"]  # it waits for the decode
    assert times["decode"].blocked > 0.2  # the rest of the 0.5 s the loop stayed away: both queues full
    assert 0 < decoding["busy"] < 1 and decoding["waiting_ms"] < decoding["working_ms"]
    assert pipe.thread_times()["prepare"].batches == times["prepare"].batches  # closed: kept, and no more
