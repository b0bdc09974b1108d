"""Where the node's image caches live (rank/data/image_cache.py): the folders in order of preference, each the user's
alone, the room a cache may take in one, the lock its builders share, and the clean-up of caches no process maps."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil

# Owner-only: a cache holds a dataset's images, and /dev/shm is shared by every user of the node
FILE_MODE, DIR_MODE = 0o600, 0o700
CACHE_GLOBS = ("images-*.bin", "files-*.bin")  # decoded images (ensure_cache), files' bytes (ensure_file_cache)


def default_dirs(disk_dir: str | Path) -> list[Path]:
    """Where caches live, in order of preference: /dev/shm (RAM), then `disk_dir` (best on a node-local disk)."""
    shm = Path("/dev/shm")
    dirs = [shm / f"ddp-launch-{os.getuid()}"] if shm.is_dir() and os.access(shm, os.W_OK) else []
    return dirs + [Path(disk_dir)]


@contextmanager
def build_lock(directory: Path, log: Callable[[str], None]):
    """Exclusive lock of the builders that share `directory`: one builds, the others wait, then map its file."""
    private_dir(directory)
    with open(os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, FILE_MODE), "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"image cache: waiting for another process building in {directory}")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield  # closing the file releases the lock, also when the build fails


def private_dir(directory: Path) -> None:
    """Create `directory` for this user alone; one of theirs that others can read is closed to them."""
    directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    st = directory.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(directory, DIR_MODE)


def room(directory: Path) -> int:
    """Bytes a cache may take in `directory`: half of what is free, and on tmpfs also half of the available RAM."""
    free = shutil.disk_usage(directory).free
    if in_ram(directory):
        free = min(free, psutil.virtual_memory().available)
    return free // 2


def in_ram(directory: Path) -> bool:
    """Whether `directory` is on tmpfs/ramfs (its pages are RAM): the filesystem of its longest mount point."""
    path, best, fstype = str(directory.resolve()), "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mount, kind = line.split()[:3]
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, fstype = mount, kind
    return fstype in ("tmpfs", "ramfs")


# --- clean-up -------------------------------------------------------------------------------------------------------
def cache_files(directory: str | Path) -> list[Path]:
    """The cache files in `directory` (none when it does not exist)."""
    directory = Path(directory)
    return sorted(p for pattern in CACHE_GLOBS for p in directory.glob(pattern)) if directory.is_dir() else []


def remove_unused(directory: str | Path, keep: Sequence[str | Path] = ()) -> list[Path]:
    """Delete the caches in `directory` that no process has mapped (except `keep`); return them.

    Also deletes temporary files left by builders on this host that are no longer running. Safe while runs use the
    folder: a mapped cache is held by its readers' shared lock and is left alone.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    remove_dead_temps(directory)
    kept = {Path(p).resolve() for p in keep}
    removed = []
    for path in cache_files(directory):
        if path.resolve() in kept:
            continue
        with open(path, "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # mapped by a run
            path.unlink()
            removed.append(path)
    return removed


def remove_dead_temps(directory: Path) -> None:
    """Delete `.<name>.<pid>@<host>.tmp` files whose builder, a process on this host, has exited."""
    host = socket.gethostname()
    for tmp in (t for pattern in CACHE_GLOBS for t in directory.glob(f".{pattern}.*.tmp")):
        pid, _, builder_host = tmp.name.removesuffix(".tmp").split(".bin.", 1)[1].partition("@")
        if builder_host == host and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        pass
    return True
