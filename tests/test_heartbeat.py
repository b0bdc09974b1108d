"""The watchdog names a hung rank (rank/group/heartbeat.py), and a signalled rank that cannot reach a step boundary still
ends (rank/group/signals.py): with a fake store, a fake clock and a fake exit, in milliseconds."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from launcher.rank.group.heartbeat import EXIT_HUNG, KEY, Heartbeat
from launcher.rank.group.signals import StopSignal, stop_when_orphaned
from launcher.run_folder import RunFolder


class FakeStore:
    """What the heartbeat uses of torch's TCPStore: set, get, check."""

    def __init__(self):
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values[key].encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def job(tmp_path):
    """Three ranks' heartbeats over one store; rank 0's exit is recorded instead of ending the test."""
    store, clock, exits = FakeStore(), Clock(), []
    folder = RunFolder(tmp_path)
    beats = [Heartbeat(store, r, 3, timeout_s=60, folder=folder, clock=clock, exit=exits.append, thread=False)
             for r in range(3)]
    return beats, clock, exits, folder


def publish(beats):
    for b in beats:
        b.publish()


def test_a_rank_working_on_one_step_past_the_timeout_while_the_others_wait_is_named(job):
    beats, clock, exits, folder = job
    for b in beats:
        b.working(7)
    beats[0].waiting(7)
    beats[2].waiting(7)  # ranks 0 and 2 wait at the step's agreement; rank 1 never gets there
    clock.t += 61
    publish(beats)
    assert beats[0].watch() == [1]
    assert exits == [EXIT_HUNG]
    (failure,) = folder.failures()
    assert failure["rank"] == 1 and failure["step"] == 7 and failure["phase"] == "train"
    assert "rank 1 made no progress for 61 s (after step 7); rank(s) 0, 2 waited for it" in failure["error"]
    assert "dist.timeout_s=60" in failure["error"]


def test_a_frozen_rank_is_blamed_not_the_rank_waiting_for_it_inside_a_collective(job):
    """Rank 1 stopped by SIGSTOP mid-step: its beats stop, while ranks 0 and 2 sit inside the step's all-reduce,
    "working" with no change either. Only rank 1 is named (it would be the run's root cause)."""
    beats, clock, exits, folder = job
    for b in beats:
        b.working(7)
    publish(beats)
    assert beats[0].watch() == []
    for _ in range(7):  # 70 s: ranks 0 and 2 still beat, rank 1 is frozen
        clock.t += 10
        beats[0].publish()
        beats[2].publish()
        beats[0].watch()
    assert exits == [EXIT_HUNG]
    (failure,) = folder.failures()
    assert failure["rank"] == 1 and failure["step"] == 7
    assert failure["error"].startswith("hung: rank 1 made no progress for 70 s (after step 7; its process stopped")
    assert "rank(s) 0, 2 waited for it" in failure["error"]


def test_a_frozen_rank_that_was_waiting_is_blamed_while_the_others_work(job):
    """Frozen just after a step's agreement ("waiting" as last published): the others are stuck working in the
    next step's collective; the silent rank is the one named."""
    beats, clock, exits, folder = job
    for b in beats:
        b.working(7)
    beats[1].waiting(7)
    publish(beats)
    beats[0].watch()
    clock.t += 61
    beats[0].publish()
    beats[2].publish()
    assert beats[0].watch() == [1] and exits == [EXIT_HUNG]
    assert [f["rank"] for f in folder.failures()] == [1]


def test_of_ranks_stuck_working_the_one_a_step_behind_is_blamed(job):
    beats, clock, exits, folder = job
    beats[0].working(8)
    beats[1].working(7)  # still in step 7's backward; ranks 0 and 2 wait in step 8's first all-reduce
    beats[2].working(8)
    clock.t += 61
    publish(beats)
    assert beats[0].watch() == [1]
    assert [f["rank"] for f in folder.failures()] == [1]


def test_no_verdict_while_the_ranks_progress_or_before_every_rank_trains(job):
    beats, clock, exits, _ = job
    beats[0].publish()
    assert beats[0].watch() == []  # ranks 1 and 2 have not published yet
    publish(beats)
    clock.t += 600
    assert beats[0].watch() == []  # everyone is still starting (dataset scans, graph capture)
    for b in beats:
        b.working(1)
    clock.t += 59
    publish(beats)
    assert beats[0].watch() == []  # within the timeout
    for b in beats:
        b.working(2)  # progress resets each rank's clock
    clock.t += 59
    publish(beats)
    assert beats[0].watch() == [] and exits == []


def test_validation_batches_count_as_progress(job):
    beats, clock, exits, _ = job
    for b in beats:
        b.working(5)
    for _ in range(5):  # a long validation: no step for 100 s, but every batch beats
        clock.t += 20
        for b in beats:
            b.working()  # what the validator's on_val_batch_end does
        publish(beats)
        assert beats[0].watch() == []
    assert json.loads(beats[1].store.get(KEY.format(1)))[1] == 5 and exits == []


def test_a_signal_without_a_step_boundary_ends_the_rank_after_the_grace(monkeypatch):
    """Ctrl-C (SIGINT) or SIGTERM to a rank deep in something that never reaches a step boundary: it exits
    128 + signal after the grace period, without a new checkpoint (torchrun kills what is left after 30 s)."""
    exited = threading.Event()
    codes = []

    def fake_exit(code):
        codes.append(code)
        exited.set()

    before = signal.getsignal(signal.SIGINT)
    stop = StopSignal(grace_s=0.05, exit=fake_exit)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT  # noted at once: the next step boundary would stop cleanly
        assert exited.wait(5), "the grace period never ended the rank"
        assert codes == [128 + signal.SIGINT]
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_rank_whose_torchrun_is_gone_sends_itself_sigterm():
    """torchrun killed outright (with or without the launcher): the rank is re-parented, notices within a period,
    and takes the Ctrl-C path (SIGTERM to itself: StopSignal saves at the next step)."""
    parents = iter([100, 100, 100, 1])  # torchrun's pid, twice more, then init's: it died
    sent, slept = [], []
    stop_when_orphaned(period_s=1.0, getppid=lambda: next(parents), kill=lambda pid, sig: sent.append((pid, sig)),
                       sleep=slept.append, thread=False)
    assert sent == [(os.getpid(), signal.SIGTERM)] and slept == [1.0, 1.0]


class Progress:
    """What a rank's heartbeat reports to its StopSignal: (state, when it last changed)."""

    def __init__(self, state="working"):
        self.state, self.changed = state, time.time()

    def __call__(self):
        return self.state, self.changed


def stopping(progress, grace_s=0.3):
    """A StopSignal that has noted SIGTERM; its exits recorded."""
    codes = []
    stop = StopSignal(grace_s=grace_s, exit=codes.append, progress=progress, period_s=0.02)
    stop._note(signal.SIGTERM, None)  # what the handler does; no real signal, so the caller's dispositions do not matter
    return stop, codes


def test_a_signalled_rank_still_making_progress_is_not_ended_and_one_that_agreed_to_stop_saves_unhurried():
    """A loaded machine: the steps after the signal are slow, but they come; a rank is ended only after grace_s
    without progress, and not at all once the ranks agreed to stop (rank 0 then writes its checkpoint)."""
    progress = Progress()
    stop, codes = stopping(progress)
    try:
        for _ in range(5):  # 0.75 s of slow steps, past the 0.3 s grace counted from the signal
            time.sleep(0.15)
            progress.changed = time.time()
        assert codes == []
        stop.decided()  # the step boundary: every rank stops here
        time.sleep(0.6)  # the checkpoint write, as long as it takes
        assert codes == []
    finally:
        stop.restore()


def test_a_signalled_rank_waiting_for_its_peers_is_left_to_them_and_a_stuck_one_ends():
    waiting = Progress("waiting")
    stop, codes = stopping(waiting)
    try:
        time.sleep(0.6)
        assert codes == []  # at a step-boundary agreement: the peers' own grace decides
        waiting.state = "working"  # stuck in a step from now on
        deadline = time.time() + 5
        while not codes and time.time() < deadline:
            time.sleep(0.02)
        assert codes == [128 + signal.SIGTERM]
    finally:
        stop.restore()


def test_the_signal_handler_writes_nothing_so_a_signal_during_a_print_cannot_break_it(monkeypatch):
    """A signal arriving while the rank prints (a validation's progress) ran a handler that printed to the same
    stream: "RuntimeError: reentrant call", and rank 0 died without its checkpoint. The handler only notes it."""

    class Busy:  # the main thread is inside a write: another from it fails; other threads' writes wait their turn
        def write(self, text):
            if threading.current_thread() is threading.main_thread():
                raise RuntimeError("reentrant call inside <_io.BufferedWriter name=1>")
            return len(text)

        def flush(self):
            pass

    stop = StopSignal(grace_s=60, exit=lambda code: None, period_s=60)
    try:
        monkeypatch.setattr("sys.stdout", Busy())
        stop._note(signal.SIGTERM, None)
        stop._note(signal.SIGTERM, None)  # the kernel's parent-death signal comes two or three times
        assert stop.signum == signal.SIGTERM
    finally:
        stop.restore()
