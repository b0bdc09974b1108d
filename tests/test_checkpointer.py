"""The checkpointer writes in the background: what it saves is the state at save(), and a failed write is not lost."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from launcher.rank.loop.checkpoint_io import RESUME_KEY, CheckpointError, load_resumable
from launcher.rank.loop.state import Checkpointer


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
                        lambda: {"epoch": int(counter.value[0])}, before_write,
                        complete=lambda checkpoint: {**checkpoint, "ema": torch.nn.Linear(2, 2)})
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


def test_a_module_in_the_layout_is_refused_rather_than_saved_live(tmp_path):
    ckpt = Checkpointer(tmp_path, {}, lambda: {"ema": torch.nn.Linear(2, 2)})
    with pytest.raises(TypeError, match="a module at ema cannot be copied"):
        ckpt.save(wait=True)


def ultralytics_checkpointer(tmp_path, before_write=lambda path: None):
    """A Checkpointer with Ultralytics' layout over a small detector-like network, its EMA and SGD's momentum."""
    from types import SimpleNamespace

    from ultralytics.utils import IterableSimpleNamespace
    from ultralytics.utils.torch_utils import ModelEMA

    from launcher.rank.components import EmaState
    from launcher.rank.ultralytics.checkpoint import Layout, stripped

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    net.anchors = torch.arange(6.0)  # a tensor outside the state, as Detect's anchors
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    ema = ModelEMA(net)
    ema.ema.criterion = torch.nn.MSELoss()  # Ultralytics' models keep their loss; a checkpoint does not
    ema.ema.args = IterableSimpleNamespace(imgsz=8)  # as DetectionModel.args
    layout = Layout(ema, SimpleNamespace(imgsz=8))
    keys = lambda: layout.keys(scaler=torch.amp.GradScaler("cuda", enabled=False), epoch=0, best_fitness=None,  # noqa: E731
                               fitness=None, early_stop={}, metrics={}, results={})
    components = {"model": net, "ema": EmaState(ema), "optimizer": optimizer}
    checkpointer = Checkpointer(tmp_path / "weights", components, keys, before_write, layout.complete, stripped)
    return checkpointer, ema, optimizer


def test_ultralytics_layout_saves_the_ema_in_fp16_as_it_was_at_each_save(tmp_path):
    """The fp16 EMA model and optimizer are made in the writer thread from the save's copies: each file holds the
    EMA and momentum of its own save (not the steps' changes after it, not the next save's), in Ultralytics' keys."""
    release = threading.Event()
    ckpt, ema, optimizer = ultralytics_checkpointer(tmp_path, before_write=lambda path: release.wait(10))
    first = {k: v.clone() for k, v in ema.ema.state_dict().items()}
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in optimizer.param_groups[0]["params"]]
    ckpt.save()
    with torch.no_grad():  # the next steps change the EMA and the optimizer in place
        for v in ema.ema.state_dict().values():
            v.add_(1)
        for p in optimizer.param_groups[0]["params"]:
            optimizer.state[p]["momentum_buffer"].add_(1)
    release.set()
    ckpt.save(wait=True)
    before, after = saved(tmp_path / "weights" / "last.prev.pt"), saved(tmp_path / "weights" / "last.pt")
    for state, shift in ((before, 0), (after, 1)):
        model = state["ema"]
        assert getattr(model, "criterion", None) is None and torch.equal(model.anchors, torch.arange(6.0))
        for name, v in model.state_dict().items():
            assert v.dtype == (torch.half if v.is_floating_point() else first[name].dtype)
            assert torch.equal(v, (first[name] + shift).to(v.dtype)), name
        saved_momentum = [s["momentum_buffer"] for s in state["optimizer"]["state"].values()]
        assert all(m.dtype == torch.half and torch.equal(m, (b + shift).half()) for m, b in zip(saved_momentum, momentum))
        resume = state[RESUME_KEY]["optimizer"]["state"]  # the resume state keeps full precision
        assert all(s["momentum_buffer"].dtype == torch.float32 for s in resume.values())
    assert before["ema"] is not after["ema"] and after["updates"] == ema.updates


def test_the_last_save_writes_the_weights_ultralytics_strip_makes_and_the_epoch_before_stays_resumable(tmp_path):
    """The run's last save writes last.pt and best.pt as final weights at once: what Ultralytics' strip_optimizer makes
    of the whole checkpoint, key for key; last.prev.pt, the save before, is what a failure before the run's end
    resumes from; epoch<N>.pt stays whole."""
    import shutil

    from launcher.rank.ultralytics.checkpoint import strip

    ckpt, ema, _ = ultralytics_checkpointer(tmp_path)
    weights = tmp_path / "weights"
    ckpt.save(wait=True)  # the same state, whole: stripped below by Ultralytics' own function
    shutil.copy(weights / "last.pt", tmp_path / "reference.pt")
    strip(tmp_path / "reference.pt")
    ckpt.save(best=True, epoch_copy=3, final=True, wait=True)

    reference = torch.load(tmp_path / "reference.pt", map_location="cpu", weights_only=False)
    for name in ("last.pt", "best.pt"):
        final = torch.load(weights / name, map_location="cpu", weights_only=False)
        assert list(final) == list(reference), name
        for key, expected in reference.items():
            if key == "model":
                model = final[key]
                assert type(model.args) is dict and model.criterion is None
                assert not any(p.requires_grad for p in model.parameters())
                assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in
                           zip(model.state_dict().values(), expected.state_dict().values(), strict=True))
            elif key != "date":
                assert final[key] == expected, key
    assert reference["optimizer"] is None and reference[RESUME_KEY] is None
    resumable, path = load_resumable(weights / "last.pt")
    assert path == weights / "last.prev.pt" and resumable[RESUME_KEY] is not None
    assert torch.load(weights / "epoch3.pt", map_location="cpu", weights_only=False)[RESUME_KEY] is not None
