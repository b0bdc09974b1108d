"""The training loop and its hooks (rank/loop/loop.py, rank/run/hooks.py) with fake steps and inputs: the order hooks run
in, where a resumed loop continues, cleanup after an error, and an early stop that every rank takes (2 gloo ranks)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.rank.run import hooks
from launcher.rank.group.dist import Comm
from launcher.rank.group.heartbeat import NoHeartbeat
from launcher.rank.loop.loop import Hook, TrainLoop
from launcher.rank.loop.state import TrainState


class FakeStep:
    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.seen = fail_at, []
        self.loss_items = None

    def __call__(self, batch: dict) -> None:
        if batch["ni"] == self.fail_at:
            raise RuntimeError("the step failed")
        self.seen.append(batch["ni"])
        self.loss_items = {"box_loss": torch.tensor(float(batch["ni"]))}


class FakeInputs:
    def __init__(self, events: list):
        self.events, self.last_wait = events, 0.0

    def begin_epoch(self, epoch: int, first_step: int, first_ni: int = 0) -> None:
        self.events.append(("begin_epoch", epoch, first_step))

    def next(self, ni: int) -> dict:
        return {"ni": ni, "im_file": ["a.jpg"]}

    def prefetch(self, ni: int) -> None:
        self.events.append(("prefetch", ni))

    def close(self) -> None: ...


class Record(Hook):
    def __init__(self, events: list, name: str = "hook"):
        self.events, self.name = events, name

    def __getattribute__(self, attr):
        if attr in ("before_train", "before_epoch", "before_step", "before_launch", "after_launch", "after_step",
                    "after_epoch", "after_train"):
            return lambda loop: self.events.append((self.name, attr, loop.state.epoch, loop.state.step))
        return super().__getattribute__(attr)


def make_loop(events, *, epochs=2, steps=3, state=None, step=None, extra=()):
    return TrainLoop(step or FakeStep(), FakeInputs(events), state or TrainState(), [Record(events), *extra],
                     epochs=epochs, steps_per_epoch=steps)


def test_hooks_run_around_every_step_and_epoch_and_the_next_batch_is_fetched_during_the_step():
    events = []
    loop = make_loop(events, epochs=2, steps=2)
    loop.run()
    assert loop.completed and loop.step.seen == [0, 1, 2, 3]
    assert events == [
        ("hook", "before_train", 0, 0),
        ("hook", "before_epoch", 0, 0), ("begin_epoch", 0, 0),
        # the step's end is stamped (after_launch) before the next batch is fetched: a wait for it is not the step's
        ("hook", "before_step", 0, 0), ("hook", "before_launch", 0, 0), ("hook", "after_launch", 0, 0),
        ("prefetch", 1), ("hook", "after_step", 0, 1),
        ("hook", "before_step", 0, 1), ("hook", "before_launch", 0, 1), ("hook", "after_launch", 0, 1),
        ("hook", "after_step", 0, 2),  # nothing fetched past the epoch's end
        ("hook", "after_epoch", 0, 2),
        ("hook", "before_epoch", 1, 0), ("begin_epoch", 1, 0),
        ("hook", "before_step", 1, 0), ("hook", "before_launch", 1, 0), ("hook", "after_launch", 1, 0),
        ("prefetch", 3), ("hook", "after_step", 1, 1),
        ("hook", "before_step", 1, 1), ("hook", "before_launch", 1, 1), ("hook", "after_launch", 1, 1),
        ("hook", "after_step", 1, 2),
        ("hook", "after_epoch", 1, 2),
        ("hook", "after_train", 1, 2),
    ]  # fmt: skip


def test_the_validation_split_is_read_after_the_first_step_and_placed_a_slice_after_each_later_one():
    """ReadAhead: the split's reading starts once the training loader runs (after the first step, never before it),
    and each later step boundary, every epoch, moves a slice of it to the device."""
    events = []
    read_ahead = hooks.ReadAhead(lambda: events.append(("read_ahead",)), lambda: events.append(("place_ahead",)))
    make_loop(events, epochs=2, steps=2, extra=[read_ahead]).run()
    ours = [(i, e) for i, e in enumerate(events) if e[0] in ("read_ahead", "place_ahead")]
    first_step_end = events.index(("hook", "after_step", 0, 1))
    assert [e for _, e in ours] == [("read_ahead",), ("place_ahead",), ("place_ahead",), ("place_ahead",)]
    assert ours[0][0] == first_step_end + 1


def test_the_input_time_is_measured_after_the_warm_up_steps_and_said_per_thread():
    """InputTime: the GPU input's GPU time and its threads' time over the steps after `skip` (a thread started
    after the window's start counts whole); the rank's log line."""
    from types import SimpleNamespace

    from launcher.rank.data.pipeline import ThreadTime

    class Inputs:
        times = {"decode": ThreadTime(1.0, 2.0, 0.0, 10)}

        def thread_times(self):
            return dict(self.times)

    class GpuInput:
        taken = iter([(9.0, 5), (4.0, 8)])  # the warm-up's, then the window's

        def take_gpu_time(self):
            return next(self.taken)

    inputs = Inputs()
    hook = hooks.InputTime(GpuInput(), inputs, skip=3)
    hook.before_step(SimpleNamespace(ni=2))
    assert hook.line() is None
    hook.before_step(SimpleNamespace(ni=3))  # the window starts
    inputs.times = {"decode": ThreadTime(1.5, 4.0, 1.0, 20), "prepare": ThreadTime(0.1, 0.2, 0.0, 2)}
    hook.after_train(None)
    assert hook.ms_per_image == pytest.approx(0.5)
    assert hook.threads["decode"] == pytest.approx({"waiting_ms": 50.0, "working_ms": 200.0, "blocked_ms": 100.0,
                                                    "batches": 10, "busy": 2.0 / 3.5})
    assert hook.threads["prepare"]["batches"] == 2
    assert hook.line() == ("the input's threads, ms per batch: decode thread (reads the loader's batches, decodes) "
                           "waiting 50.0, working 200.0, ahead 100.0; augmenting thread waiting 50.0, working 100.0, "
                           "ahead 0.0")


def test_a_loop_resumed_mid_epoch_continues_at_its_step_with_the_mean_loss_of_the_steps_before():
    state = TrainState(epoch=1, step=2, tloss={"box_loss": torch.tensor(10.0)}, tloss_steps=2)
    loop = make_loop([], epochs=2, steps=3, state=state)
    loop.run()
    assert loop.step.seen == [5]  # epoch 1, step 2: the run's sixth step
    assert float(state.tloss["box_loss"]) == pytest.approx((10.0 * 2 + 5.0) / 3)


def test_a_checkpoint_during_an_epochs_end_resumes_at_the_next_epoch_and_after_its_last_step_at_its_end():
    positions = []

    class Save(Hook):
        def after_step(self, loop):
            positions.append(("step", loop.state.position))

        def after_epoch(self, loop):
            positions.append(("epoch end", loop.state.position))

    make_loop([], epochs=1, steps=2, extra=[Save()]).run()
    # after the last step: (0, 2), so a run stopped there still does the epoch's end; during it: (1, 0)
    assert positions == [("step", (0, 1)), ("step", (0, 2)), ("epoch end", (1, 0))]
    events = []
    make_loop(events, epochs=1, steps=2, state=TrainState(epoch=0, step=2)).run()
    assert ("hook", "after_epoch", 0, 2) in events and not any(e[1] == "before_step" for e in events)


def test_after_train_runs_for_every_hook_when_a_step_fails_and_when_a_hook_fails():
    events = []

    class Broken(Hook):
        def after_train(self, loop):
            raise OSError("a hook's cleanup failed")

    loop = TrainLoop(FakeStep(fail_at=1), FakeInputs(events), TrainState(), [Broken(), Record(events, "last")],
                     epochs=1, steps_per_epoch=3)
    with pytest.raises(OSError, match="cleanup failed") as raised:
        loop.run()
    assert isinstance(raised.value.__context__, RuntimeError)  # the step's error is kept as the cause
    assert ("last", "after_train", 0, 1) in events and not loop.completed


def test_an_agreed_stop_ends_the_loop_after_that_epoch():
    class StopAfterFirst(Hook):
        def after_epoch(self, loop):
            loop.state.stop = True

    loop = make_loop([], epochs=5, steps=1, extra=[StopAfterFirst()])
    loop.run()
    assert loop.completed and loop.step.seen == [0] and loop.state.epoch == 0


class FakeCheckpointer:
    def __init__(self):
        self.saves = []

    def save(self, **kwargs) -> None:
        self.saves.append(kwargs)

    def wait(self) -> None: ...


@pytest.mark.parametrize("stop_after, best_epochs, written", [(None, {1, 3}, {"last.pt", "best.pt"}),
                                                              (None, {1}, {"last.pt"}),
                                                              (2, {1, 2}, {"last.pt", "best.pt"})])
def test_the_runs_last_save_is_the_final_weights_and_only_the_rest_is_stripped_after(stop_after, best_epochs, written):
    """The last epoch's save (the last of the run, or the one an early stop ends) writes the final weights at once;
    once the run has completed, only what that save did not write is stripped (best.pt of an earlier epoch)."""

    class Validated(Hook):  # the epoch's fitness, and an early stop after `stop_after` epochs
        def after_epoch(self, loop):
            loop.state.validated_epochs.append(loop.state.epoch + 1)
            loop.state.fitness_epoch = loop.state.epoch + 1 if loop.state.epoch + 1 in best_epochs else 1
            loop.state.stop = loop.state.epoch + 1 == stop_after

    checkpointer, stripped = FakeCheckpointer(), []
    loop = make_loop([], epochs=3, steps=1, extra=[Validated(), hooks.Checkpoint(checkpointer, 0, stripped.append)])
    loop.run()
    epochs = stop_after or 3
    assert [s["final"] for s in checkpointer.saves] == [False] * (epochs - 1) + [True]
    assert checkpointer.saves[-1]["best"] == (epochs in best_epochs)
    assert stripped == [written]


def test_a_run_that_does_not_complete_strips_nothing():
    checkpointer, stripped = FakeCheckpointer(), []
    loop = make_loop([], epochs=3, steps=2, step=FakeStep(fail_at=3),
                     extra=[hooks.Checkpoint(checkpointer, 0, stripped.append)])
    with pytest.raises(RuntimeError, match="the step failed"):
        loop.run()
    assert [s["final"] for s in checkpointer.saves] == [False] and stripped == []


class FakeComm:
    """One rank of a job whose other ranks contribute `others` to every all-reduce."""

    def __init__(self, rank: int, others: int = 0):
        self.rank, self.others, self.barriers = rank, others, 0

    def max(self, value: int) -> int:
        return max(value, self.others)

    def barrier(self) -> None:
        self.barriers += 1


@pytest.mark.parametrize("rank, own, others", [(0, 15, 0), (1, 0, 15), (0, 0, 2)])
def test_a_signal_on_any_rank_stops_every_rank_after_the_same_step_and_each_log_says_where_it_came_from(rank, own, others):
    """A rank whose own SIGTERM has not arrived (torchrun signals the ranks one after another) stops with the rest,
    and its log says why it ended; only rank 0 saves, and no rank leaves before the save (the barrier)."""
    saved, lines = [], []
    comm = FakeComm(rank, others)
    stop = hooks.StopOnSignal(comm, NoHeartbeat(), FakeInputs([]), save=saved.append, log=lines.append)
    loop = make_loop([], epochs=1, steps=4)
    loop.state.step = 2
    stop.before_train(loop)
    try:
        stop.stop_signal.signum = own
        with pytest.raises(SystemExit) as stopped:
            stop.after_step(loop)
    finally:
        stop.after_train(loop)
    name = "SIGTERM" if max(own, others) == 15 else "SIGINT"
    assert stopped.value.code == 128 + max(own, others) and comm.barriers == 1
    where = "this rank" if own else "another rank"
    assert lines[0] == f"[signal] stopping after epoch 1 step 2: {name} reached {where}"
    assert (len(saved), len(lines)) == ((1, 2) if rank == 0 else (0, 1))


def test_without_a_signal_the_step_boundary_goes_on():
    stop = hooks.StopOnSignal(FakeComm(0), NoHeartbeat(), FakeInputs([]), save=lambda loop: pytest.fail("saved"))
    loop = make_loop([], epochs=1, steps=4)
    stop.before_train(loop)
    try:
        stop.after_step(loop)  # returns: nobody was signalled
    finally:
        stop.after_train(loop)


# --- an early stop decided on rank 0 and taken by every rank (2 gloo ranks) -----------------------------------------
FITNESS = [0.50, 0.60, 0.60, 0.55, 0.90, 0.95]  # better at epochs 1 and 2, then none for `patience` epochs


class FakeEvaluate(Hook):
    """What Evaluate leaves in the state: every rank validated, only rank 0 knows the fitness."""

    def __init__(self, rank: int):
        self.rank = rank

    def after_epoch(self, loop):
        loop.state.validated_epochs.append(loop.state.epoch + 1)
        loop.state.fitness = FITNESS[loop.state.epoch] if self.rank == 0 else None


def _early_stop_rank(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    comm = Comm(rank, 2, dist.group.WORLD)
    loop = TrainLoop(FakeStep(), FakeInputs([]), TrainState(), [
        FakeEvaluate(rank), hooks.EarlyStop(patience=2, log=print), hooks.AgreeToStop(comm, NoHeartbeat()),
    ], epochs=len(FITNESS), steps_per_epoch=2)
    loop.run()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"epochs": loop.state.epoch + 1, "steps": loop.step.seen}, f)
    dist.destroy_process_group()


@pytest.mark.dist
def test_an_early_stop_decided_on_rank_0_is_taken_by_every_rank_at_the_same_epoch(tmp_path):
    out = str(tmp_path / "ranks")
    mp.start_processes(_early_stop_rank, args=(str(tmp_path / "init"), out), nprocs=2, start_method="spawn")
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in (0, 1)]
    assert ranks[0] == ranks[1] == {"epochs": 4, "steps": list(range(8))}  # epoch 4: 2 epochs without a better one
