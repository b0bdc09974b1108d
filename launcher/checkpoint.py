"""Checkpoint files written atomically and read defensively.

A checkpoint is written to a temporary file beside its target, flushed to disk (fsync), and renamed over the target
(os.replace is atomic on POSIX): a process killed mid-write, or a full disk, leaves the previous checkpoint intact
and at most a temporary file, which is removed on the error path.
"""

from __future__ import annotations

import os
from pathlib import Path

TMP_MARK = ".tmp-"


class CheckpointError(RuntimeError):
    pass


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
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
