"""Checkpoint files read defensively (they are written atomically by run_folder.atomic_write_bytes).

A process killed mid-write, or a full disk, leaves the previous checkpoint intact and at most a temporary file,
removed on the error path or, after a SIGKILL, by the next run (remove_stale_temporaries).
"""

from __future__ import annotations

from pathlib import Path

from launcher.run_folder import TMP_MARK, previous_of

RESUME_KEY = "ddp_launch_state"  # full-precision training state inside last.pt (removed when the run finishes)


class CheckpointError(RuntimeError):
    pass


def load_resumable(path: Path, log=print, fits=None) -> tuple[dict | None, Path | None]:
    """The newest readable checkpoint holding resume state among `path` and its `.prev`; (None, None) if none exist.

    An unreadable candidate, or one `fits(ckpt)` says does not fit (a reason, or None when it fits: another model's
    weights), is reported by name and the previous one tried. If checkpoints exist but none can be used, that is an
    error: the run never silently starts again from zero.
    """
    candidates = [p for p in (Path(path), previous_of(path)) if p.exists()]
    failures = []
    for candidate in candidates:
        try:
            ckpt = load(candidate)
        except CheckpointError as e:
            failures.append(str(e))
            log(f"WARNING: {e}; trying the previous checkpoint")
            continue
        if ckpt.get(RESUME_KEY) is None:  # stripped: strip_optimizer leaves the key, set to None
            failures.append(f"{candidate} holds no resume state (a finished run's final weights?)")
            continue
        misfit = fits(ckpt) if fits is not None else None
        if misfit:
            failures.append(f"checkpoint {candidate} {misfit}")
            log(f"WARNING: checkpoint {candidate} {misfit}; trying the previous checkpoint")
            continue
        return ckpt, candidate
    if candidates:
        raise CheckpointError("no usable checkpoint to resume from: " + "; ".join(failures))
    return None, None


def mismatch(expected: dict, given: dict) -> str | None:
    """How state dict `given` (a checkpoint's) fails to fit a network whose state dict is `expected`, in a few words
    naming one tensor; None when every tensor is there with its shape."""
    missing = [k for k in expected if k not in given]
    extra = [k for k in given if k not in expected]
    if missing or extra:
        name = (missing or extra)[0]
        return (f"is another model's: {len(missing)} of the network's {len(expected)} tensors missing, {len(extra)} "
                f"foreign ({name})")
    for key, tensor in expected.items():
        if tuple(given[key].shape) != tuple(tensor.shape):
            return (f"is another model's: {key} is {list(given[key].shape)} there, {list(tensor.shape)} in this run's "
                    "network")
    return None


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Temporary files left by a writer that was SIGKILLed (nothing else can clean them up)."""
    removed = []
    if Path(folder).is_dir():
        for p in Path(folder).glob(f".*{TMP_MARK}*"):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def load(path: Path) -> dict:
    """torch.load a checkpoint, turning any failure into a CheckpointError that names the file."""
    import torch

    path = Path(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(ckpt, dict) or ckpt.get("ema") is None and ckpt.get("model") is None:
        raise CheckpointError(f"checkpoint {path} holds no model")
    return ckpt
