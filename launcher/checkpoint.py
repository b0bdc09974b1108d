"""Checkpoint files written atomically and read defensively.

A checkpoint is written to a temporary file beside its target, flushed to disk (fsync), and renamed over the target
(os.replace is atomic on POSIX): a process killed mid-write, or a full disk, leaves the previous checkpoint intact
and at most a temporary file, which is removed on the error path.
"""

from __future__ import annotations

import os
from pathlib import Path

TMP_MARK = ".tmp-"
RESUME_KEY = "ddp_launch_state"  # full-precision training state inside last.pt (removed when the run finishes)


class CheckpointError(RuntimeError):
    pass


def atomic_write_bytes(path: Path, data: bytes, keep_previous: bool = False) -> None:
    """Write `path` so that it is always either the old file or the complete new one.

    With `keep_previous`, the file it replaces becomes `<name>.prev.pt`: each moment leaves at least one complete
    checkpoint, because the new file is complete (fsynced) before the current one becomes the previous one, and a
    crash between the two renames leaves the previous one in place.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_of(path))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def previous_of(path: Path) -> Path:
    return Path(path).with_name(Path(path).stem + ".prev" + Path(path).suffix)


def load_resumable(path: Path, log=print) -> tuple[dict | None, Path | None]:
    """The newest readable checkpoint holding resume state among `path` and its `.prev`; (None, None) if none exist.

    An unreadable candidate is reported by name and the previous one tried. If checkpoints exist but none can be
    used, that is an error: the run never silently starts again from zero.
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
        if RESUME_KEY not in ckpt:
            failures.append(f"{candidate} holds no resume state (a finished run's final weights?)")
            continue
        return ckpt, candidate
    if candidates:
        raise CheckpointError("no usable checkpoint to resume from: " + "; ".join(failures))
    return None, None


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
