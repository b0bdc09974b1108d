"""The node-wide image cache when things go wrong: a damaged file found and rebuilt, a failed build that leaves
nothing, no room (disk after /dev/shm, then a refusal before writing), unused caches removed to make room (never one
mapped or being built), and files that are the user's alone. Building and sharing it: tests/test_image_cache.py."""

from __future__ import annotations

import errno
import gc
import os
import pickle
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

from launcher.rank.data import image_cache, image_cache_folders
from launcher.rank.data.image_cache import CacheError, ImageCache
from launcher.rank.data.image_cache_folders import remove_unused
from launcher.rank.ultralytics.datasets import load_resized
from tests.test_image_cache import build, cache_files, small_dataset, touch_all


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A dataset folder with odd-sized images (97x71), as tests/test_image_cache.py's."""
    return small_dataset(tmp_path_factory)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _flip_index_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def _clear_magic(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"\0" * 8)


@pytest.mark.parametrize("damage", [_truncate, _flip_index_byte, _clear_magic], ids=["truncated", "index", "magic"])
def test_a_damaged_cache_is_detected_and_rebuilt(small, tmp_path, damage):
    path = build(small, [tmp_path]).path
    gc.collect()  # drop the map before damaging the file under it
    damage(path)
    with pytest.raises(CacheError):
        ImageCache(path)
    logs: list[str] = []
    cache = build(small, [tmp_path], log=logs.append)
    assert any("building it again" in line for line in logs) and any(" built " in line for line in logs)
    for i, f in enumerate(cache.files):
        assert np.array_equal(cache.image(i)[0], load_resized(f, 64)[0])


def test_a_failed_build_leaves_no_file(small, tmp_path, monkeypatch):
    dirs = [tmp_path / "shm", tmp_path / "disk"]
    write, calls = image_cache._pwrite_all, []

    def disk_full_on_the_third_image(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(fd, data, offset)

    monkeypatch.setattr(image_cache, "_pwrite_all", disk_full_on_the_third_image)
    with pytest.raises(CacheError, match="ran out of space"):
        build(small, dirs, threads=2)
    assert cache_files(*dirs) == []
    monkeypatch.setattr(image_cache, "_pwrite_all", write)
    assert len(build(small, dirs)) == 12


def test_no_room_falls_back_to_disk_then_fails_before_writing(small, tmp_path, monkeypatch):
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    logs: list[str] = []
    monkeypatch.setattr(image_cache_folders, "room", lambda d: 0 if d == shm else 2**40)
    first = build(small, [shm, disk], log=logs.append)
    assert first.path.parent == disk
    assert any(f"{shm} has room for 0.0 MiB" in line for line in logs)

    monkeypatch.setattr(image_cache_folders, "room", lambda d: 0)
    with pytest.raises(CacheError, match="no room for an image cache"):
        build(small, [shm, disk], imgsz=96)
    assert cache_files(shm, disk) == [first.path.name]


def test_unused_caches_are_removed_to_make_room(small, tmp_path, monkeypatch):
    held = build(small, [tmp_path], imgsz=64)
    build(small, [tmp_path], imgsz=96)  # dropped at once: unused
    gc.collect()
    logs: list[str] = []
    # room only when no other cache but the held one is left
    monkeypatch.setattr(image_cache_folders, "room", lambda d: 2**40 if len(list(d.glob("images-*.bin"))) <= 1 else 0)
    new = build(small, [tmp_path], imgsz=128, log=logs.append)
    assert any("removed the unused cache" in line and "96px" in line for line in logs)
    assert cache_files(tmp_path) == sorted([held.path.name, new.path.name])


def test_remove_unused_keeps_what_is_mapped_and_live_builders_temp_files(small, tmp_path):
    held = build(small, [tmp_path], imgsz=64)
    unused = build(small, [tmp_path], imgsz=96).path
    kept = build(small, [tmp_path], imgsz=128).path
    gc.collect()
    host, gone = socket.gethostname(), _exited_pid()
    dead = tmp_path / f".{unused.name}.{gone}@{host}.tmp"
    live = tmp_path / f".{unused.name}.{os.getpid()}@{host}.tmp"
    elsewhere = tmp_path / f".{unused.name}.{gone}@another-host.example.org.tmp"
    for f in (dead, live, elsewhere):
        f.write_bytes(b"half an image")

    assert remove_unused(tmp_path, keep=[kept]) == [unused]
    assert not dead.exists() and live.exists() and elsewhere.exists()
    assert held.path.exists() and kept.exists() and touch_all(held) > 0


def _exited_pid() -> int:
    """The pid of a process that has exited (not reused this soon)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_cache_pickles_as_its_path(small, tmp_path):
    cache = build(small, [tmp_path])
    again = pickle.loads(pickle.dumps(cache))
    assert again.path == cache.path and len(pickle.dumps(cache)) < 500
    for i in range(len(cache)):
        assert np.array_equal(again.image(i)[0], cache.image(i)[0])
    with pytest.raises(ValueError, match="read-only"):
        cache.image(0)[0][0, 0, 0] = 1


def test_cache_files_are_the_users_alone_and_ddp_env_clears_the_unused_ones(small, tmp_path, monkeypatch, capsys):
    from launcher import env
    dirs = [tmp_path / "shm" / "ddp-launch-test", tmp_path / "disk"]
    held = build(small, dirs)
    assert held.path.stat().st_mode & 0o777 == 0o600 and dirs[0].stat().st_mode & 0o777 == 0o700
    unused = build(small, dirs, imgsz=32).path
    gc.collect()  # its map closed: nobody holds it
    monkeypatch.setattr(image_cache_folders, "default_dirs", lambda disk: dirs)
    env.main(["--clear-cache", "--cache", str(tmp_path)])
    out = capsys.readouterr().out
    assert not unused.exists() and held.path.exists()  # a mapped cache is in use: kept
    assert f"{dirs[0]}: removed 1 cache file(s)" in out and "1 in use by a running job, kept" in out
