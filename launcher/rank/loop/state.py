"""Where training stands (TrainState), and the checkpoint built from the state of every component.

The checkpoint is Ultralytics' layout (`YOLO("last.pt")` loads it: fp16 EMA, training arguments, metrics, results)
plus, under RESUME_KEY, the exact training state: each component's `state_dict()` by name (the raw model, the EMA,
the optimizer and the GradScaler in full precision, this TrainState, the early stop's memory). Resuming calls each
component's `load_state_dict()` with its own part, so nothing is resumed approximately.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from launcher.rank.loop.checkpoint_io import RESUME_KEY, CheckpointError
from launcher.run_folder import atomic_write_bytes


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainState:
    """The loop's position and the run's record so far: what a resumed run needs to continue exactly."""

    epoch: int = 0  # the epoch being trained (0-based)
    step: int = 0  # the next step of that epoch
    best_fitness: float | None = None
    fitness: float | None = None  # of the last validation
    fitness_epoch: int | None = None  # the epoch (1-based) best.pt holds
    validated_epochs: list[int] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # the last validation's metrics (rank 0)
    tloss: dict | None = None  # the running mean of this epoch's loss items, on the device (no host sync)
    tloss_steps: int = 0
    world_size: int = 1  # of the run that wrote the state: a resume at another size restarts the epoch
    global_batch: int = 0
    epoch_ended: bool = False  # the epoch's steps and its end are being done: a checkpoint resumes at the next one
    stop: bool = False  # not saved: agreed at each epoch end
    resumed_from: Path | None = None
    device: torch.device | None = None  # where the running loss lives

    @property
    def validated(self) -> bool:
        """The current epoch has been validated."""
        return self.validated_epochs[-1:] == [self.epoch + 1]

    def add_loss(self, items: dict) -> None:
        n = self.tloss_steps = self.tloss_steps + 1
        self.tloss = dict(items) if self.tloss is None else {k: (self.tloss[k] * (n - 1) + v) / n for k, v in items.items()}

    def reset_loss(self) -> None:
        self.tloss, self.tloss_steps = None, 0

    @property
    def position(self) -> tuple[int, int]:
        """Where a run resumed from this state starts: after an epoch's last step but before its end (validation,
        the results row, the checkpoint), (epoch, steps per epoch), so that the end is done once."""
        return (self.epoch + 1, 0) if self.epoch_ended else (self.epoch, self.step)

    def state_dict(self) -> dict:
        return {
            "position": self.position,  # (epoch, step) the next step trains
            "best_fitness": self.best_fitness,
            "fitness": self.fitness,
            "fitness_epoch": self.fitness_epoch,
            "validated_epochs": list(self.validated_epochs),
            "metrics": dict(self.metrics),
            "tloss": {k: float(v) for k, v in (self.tloss or {}).items()},  # the epoch's mean loss so far
            "tloss_steps": self.tloss_steps,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["position"]
        self.best_fitness, self.fitness = state.get("best_fitness"), state.get("fitness")
        self.fitness_epoch = state["fitness_epoch"]
        self.validated_epochs = list(state["validated_epochs"])
        self.metrics = dict(state.get("metrics") or {})
        self.tloss_steps = state["tloss_steps"] if state.get("tloss") else 0
        self.tloss = {k: torch.tensor(v, device=self.device) for k, v in state["tloss"].items()} if state.get("tloss") else None
        self.world_size, self.global_batch = state["world_size"], state["global_batch"]


class Checkpointer:
    """Writes last.pt (the one it replaces kept as last.prev.pt), best.pt and epochN.pt; loads the newest usable one.

    `components` are saved and restored by name; `layout()` gives Ultralytics' keys of the checkpoint at that
    moment, and `complete(checkpoint)`, in the writer thread, the keys it derives from the host copies (the fp16 EMA
    model and optimizer, made from the resume state's copies rather than copied again); `before_write(path)` is the
    fault injector's hook (tests kill the writer half-way), `on_save()` its note of each save as it is taken, in the
    training thread with no write in flight (a fault is then judged by the step saved, not by how far training has
    gone while the writer runs); `finish(checkpoint)` the final weights made from a
    completed checkpoint (ultralytics/checkpoint.py's stripped).

    `save()` takes the state at once, as host copies queued on the GPU's stream (so the steps that follow cannot
    change it, and the training thread does not wait for them), and completes, serialises and writes it in a
    background thread while training goes on: the whole write, flushed to disk, is off the epoch boundary. One write
    is in flight at a time: the next `save()` and `wait()` join it first and raise its error. Whoever reads the files
    during the run (the final validation's best.pt, the stripping) or ends the process (a signal's stop) calls
    `wait()` first.

    The run's last save (`final`) writes last.pt (and best.pt, when that epoch is the best) as the final weights at
    once, not a resumable checkpoint to be read back and stripped after the run: last.prev.pt, the epoch before,
    stays resumable until the run has ended (the caller removes it then).
    """

    def __init__(self, weights: Path, components: dict[str, Stateful], layout: Callable[[], dict],
                 before_write: Callable[[Path], None] = lambda path: None,
                 complete: Callable[[dict], dict] = lambda checkpoint: checkpoint,
                 finish: Callable[[dict], dict] = lambda checkpoint: checkpoint,
                 on_save: Callable[[], None] = lambda: None):
        self.weights, self.components, self.layout, self.before_write = Path(weights), components, layout, before_write
        self.on_save = on_save
        self.complete, self.finish = complete, finish
        self.last, self.best = self.weights / "last.pt", self.weights / "best.pt"
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._host = HostCopy()  # one write at a time: the next save's copies reuse the last one's buffers
        self.write_s: list[float] = []  # each background write's seconds (serialising, writing, flushing)

    def snapshot(self) -> dict:
        """The whole checkpoint as host objects owned by it alone, complete (waits for the copies)."""
        self.wait()  # the write in flight reads the copies' buffers
        snapshot = self._take()
        self._host.ready()
        return self.complete(snapshot)

    def _take(self) -> dict:
        """The checkpoint's host copies, queued: read them after `self._host.ready()`."""
        resume = {name: c.state_dict() for name, c in self.components.items()}
        return self._host.take({**self.layout(), RESUME_KEY: resume})

    def save(self, *, best: bool = False, epoch_copy: int | None = None, wait: bool = False,
             final: bool = False) -> None:
        """last.pt, and best.pt / epoch<N>.pt when asked, written in the background (`wait`: before returning);
        `final`: last.pt and best.pt as the final weights (epoch<N>.pt stays whole). A full disk is an error naming the
        folder, with the previous checkpoint intact, raised here or by `wait()`."""
        self.wait()
        self.on_save()
        snapshot = self._take()
        self._writer = threading.Thread(target=self._write, args=(snapshot, best, epoch_copy, final), daemon=True,
                                        name="ddp-launch-checkpoint")
        self._writer.start()
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until the write in flight is on disk; its error, if it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, snapshot: dict, best: bool, epoch_copy: int | None, final: bool) -> None:
        started = time.perf_counter()
        try:
            self._host.ready()
            snapshot = self.complete(snapshot)
            whole = _serialised(snapshot) if not final or epoch_copy is not None else None
            data = _serialised(self.finish(snapshot)) if final else whole
            self.before_write(self.last)
            atomic_write_bytes(self.last, data, keep_previous=True)
            if best:
                atomic_write_bytes(self.best, data)
            if epoch_copy is not None:
                atomic_write_bytes(self.weights / f"epoch{epoch_copy}.pt", whole)
        except OSError as e:
            self._error = CheckpointError(
                f"could not write a checkpoint to {self.weights} ({e.strerror or e}); the previous checkpoint "
                f"({self.last if self.last.exists() else 'none yet'}) is intact. Free space and resume with "
                f"ddp-launch resume={self.weights.parent}"
            )
            self._error.__cause__ = e
        except BaseException as e:  # noqa: BLE001 - raised in the training thread by wait()
            self._error = e
        self.write_s.append(time.perf_counter() - started)


def _serialised(checkpoint: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


class HostCopy:
    """Host copies of a structure's tensors (dicts, lists, tuples, named tuples of them), owned by the copy alone.

    A device tensor is copied into a pinned host buffer kept for the next copy of the same place in the structure,
    with the copy queued on the current stream (the order the steps see: what the next steps change in place reaches
    no copy), so the caller does not wait for the GPU; `ready()` does, before anyone reads the copies. Until then,
    and while a copy is being read, the next `take()` must not be called (the Checkpointer writes one at a time).
    A host tensor is cloned at once. The buffers hold the state's size in pinned memory (yolov8s: its weights, its EMA
    and SGD's momentum, 0.14 GB).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._queued: set[torch.device] = set()  # the devices with copies queued since the last ready()
        self._done: list[torch.cuda.Event] = []

    def take(self, obj):
        """`obj` with every tensor replaced by its host copy (a device's: queued)."""
        copied = self._take(obj, ())
        for device in self._queued:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))  # after the copies queued on it
            self._done.append(event)
        self._queued.clear()
        return copied

    def ready(self) -> None:
        """Until every queued copy is on the host."""
        for event in self._done:
            event.synchronize()
        self._done.clear()

    def _take(self, obj, where: tuple):
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj.detach(), where)
        if isinstance(obj, torch.nn.Module):  # its tensors would be the live ones
            raise TypeError(f"a module at {'/'.join(map(str, where))} cannot be copied: give its state_dict(), or "
                            f"build the module from the copies in the checkpointer's complete()")
        if isinstance(obj, dict):
            return {k: self._take(v, (*where, k)) for k, v in obj.items()}
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*(self._take(v, (*where, i)) for i, v in enumerate(obj)))
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._take(v, (*where, i)) for i, v in enumerate(obj))
        return obj

    def _tensor(self, t: torch.Tensor, where: tuple) -> torch.Tensor:
        if t.device.type != "cuda":
            return t.to("cpu", copy=True)
        buffer = self._buffers.get(where)
        if buffer is None or buffer.shape != t.shape or buffer.stride() != t.stride() or buffer.dtype != t.dtype:
            buffer = self._buffers[where] = torch.empty_like(t, device="cpu", pin_memory=True)  # its strides
        buffer.copy_(t, non_blocking=True)
        self._queued.add(t.device)
        return buffer


def upgrade(ckpt: dict) -> dict:
    """The resume state by component; a checkpoint written before components had their own parts (one flat dict
    with the position at its top) is converted."""
    state = ckpt[RESUME_KEY]
    if "position" not in state:
        return state
    stopper = ckpt.get("stopper") or {}
    train = {k: state.get(k) for k in ("position", "fitness", "fitness_epoch", "validated_epochs", "metrics", "tloss",
                                       "tloss_steps", "world_size", "global_batch")}
    return {
        "model": state["model"],
        "ema": {"weights": state["ema"], "updates": state["ema_updates"]},
        "optimizer": state["optimizer"],
        "scaler": state["scaler"],
        "train": {**train, "best_fitness": ckpt.get("best_fitness")},
        "early_stop": {"best_fitness": stopper.get("best_fitness", 0.0), "best_epoch": stopper.get("best_epoch", 0)},
    }
