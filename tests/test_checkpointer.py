"""The checkpointer writes in the background: what it saves is the state at save(), and a failed write is not lost."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from launcher.rank.checkpoint_io import RESUME_KEY, CheckpointError, load_resumable
from launcher.rank.state import Checkpointer


class Counter:
    def __init__(self):
        self.value = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"value": self.value}  # a reference, as an optimizer's state_dict() gives

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def checkpointer(tmp_path, before_write=lambda path: None):
    net, counter = torch.nn.Linear(2, 2), Counter()
    ckpt = Checkpointer(tmp_path / "weights", {"model": net, "counter": counter},
                        lambda: {"ema": torch.nn.Linear(2, 2), "epoch": int(counter.value[0])}, before_write)
    return ckpt, net, counter


def saved(path) -> dict:
    ckpt, _ = load_resumable(path)
    return ckpt


def test_a_checkpoint_holds_the_state_at_save_not_what_the_next_steps_make_of_it(tmp_path):
    release = threading.Event()
    ckpt, net, counter = checkpointer(tmp_path, before_write=lambda path: release.wait(10))
    counter.value += 1
    ckpt.save(best=True)
    with torch.no_grad():  # the steps after the save change every tensor in place
        counter.value += 5
        net.weight.fill_(7.0)
    release.set()
    ckpt.wait()
    for name in ("last.pt", "best.pt"):
        state = saved(tmp_path / "weights" / name)
        assert state["epoch"] == 1 and torch.equal(state[RESUME_KEY]["counter"]["value"], torch.ones(3))
        assert not (state[RESUME_KEY]["model"]["weight"] == 7.0).all()


def test_save_returns_while_the_write_goes_on_and_the_next_save_waits_for_it(tmp_path):
    release, entered = threading.Event(), []
    ckpt, _, counter = checkpointer(tmp_path, before_write=lambda path: (entered.append(path), release.wait(10)))
    ckpt.save()
    assert not (tmp_path / "weights" / "last.pt").exists()  # save() came back before the file was written
    threading.Timer(0.3, release.set).start()
    counter.value += 2
    ckpt.save()  # joins the first write before taking its own state
    ckpt.wait()
    assert len(entered) == 2 and len(ckpt.write_s) == 2
    assert saved(tmp_path / "weights" / "last.pt")["epoch"] == 2
    assert saved(tmp_path / "weights" / "last.prev.pt")["epoch"] == 0


def test_a_write_that_fails_in_the_background_is_raised_by_the_next_wait_and_keeps_the_previous_file(tmp_path):
    failures = []

    def disk_full_once(path):
        if not failures:
            failures.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    ckpt, _, counter = checkpointer(tmp_path)
    ckpt.save(wait=True)
    ckpt.before_write = disk_full_once
    counter.value += 3
    ckpt.save()
    with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint .*last.pt. is intact"):
        ckpt.wait()
    ckpt.wait()  # raised once, then the checkpointer is usable again
    assert saved(tmp_path / "weights" / "last.pt")["epoch"] == 0
    ckpt.save(wait=True)
    assert saved(tmp_path / "weights" / "last.pt")["epoch"] == 3
