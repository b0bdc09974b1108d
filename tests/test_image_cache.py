"""The node-wide image cache: Ultralytics' pixels, one copy per node, built once, never half-built or silently stale.

The RAM figures are printed (`pytest -s`) and recorded as junit properties: the cache's resident
memory with 1 and 2 processes, and Ultralytics' cache='ram' with 1 and 2 processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from ultralytics.cfg import get_cfg
from ultralytics.data.dataset import YOLODataset

from launcher.rank.data import image_cache_folders
from launcher.rank.data.image_cache import CacheError, ImageCache
from launcher.rank.ultralytics import datasets
from launcher.rank.ultralytics.datasets import attach_cache, load_resized
from launcher.rank.ultralytics.datasets import ensure_split_cache as ensure_cache
from launcher.inputs.shapes import CLASSES, ShapesSpec, ensure_dataset


# --- data and helpers -----------------------------------------------------------------------------------------------
def small_dataset(tmp_path_factory) -> Path:
    """A dataset folder with odd-sized images (97x71): resizing rounds, and shrinks or enlarges by imgsz."""
    spec = ShapesSpec(train_images=12, val_images=6, width=97, height=71, seed=1)
    return ensure_dataset(tmp_path_factory.mktemp("small"), spec, workers=1, log=lambda *_: None).parent


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return small_dataset(tmp_path_factory)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """64 textured 640x480 JPEGs: 56 MiB decoded at imgsz 640, far above the noise of a process's memory."""
    spec = ShapesSpec(train_images=64, val_images=1, width=640, height=480, texture=True)
    return ensure_dataset(tmp_path_factory.mktemp("photos"), spec, log=lambda *_: None).parent


@pytest.fixture
def shm_dir():
    """A private folder on /dev/shm (tmpfs), removed afterwards."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="ddp-launch-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def yolo_dataset(folder: Path, split: str, imgsz: int, *, augment: bool, channels: int = 3, cache=False, **hyp):
    """Ultralytics' YOLODataset as its trainer builds it: training augments, validation uses rect batches."""
    return YOLODataset(
        img_path=str(folder / "images" / split),
        imgsz=imgsz,
        augment=augment,
        rect=not augment,
        batch_size=4,
        hyp=get_cfg(overrides=hyp),
        cache=cache,
        data={"names": dict(enumerate(CLASSES)), "channels": channels},
    )


def build(folder: Path, dirs, imgsz: int = 64, split: str = "train", **kwargs) -> ImageCache:
    kwargs.setdefault("log", lambda *_: None)
    return ensure_cache(str(folder / "images" / split), imgsz, dirs=dirs, **kwargs)


def cache_files(*dirs: Path) -> list[str]:
    """What is in the cache folders, the lock files left out."""
    return sorted(p.name for d in dirs if d.is_dir() for p in d.iterdir() if p.name != ".lock")


def mapping_kib(path: Path) -> Counter:
    """This process's memory in the mappings of `path`, from /proc/self/smaps (KiB per field: Rss, Pss, ...)."""
    totals, inside = Counter(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's first line: address range, perms, offset, dev, inode, path
            inside = fields[-1] == str(path)
        elif inside and fields[-1] == "kB":
            totals[fields[0][:-1]] += int(fields[1])
    return totals


def private_kib() -> int:
    """This process's private memory (pages no other process maps), from /proc/self/smaps_rollup."""
    rollup = dict(line.split()[:2] for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    return int(rollup["Private_Clean:"]) + int(rollup["Private_Dirty:"])


def touch_all(cache: ImageCache) -> int:
    """Read every pixel (the checksum is compared between processes)."""
    return sum(int(cache.image(i)[0].sum(dtype=np.uint64)) for i in range(len(cache)))


# --- what the cache holds -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("imgsz,channels", [(64, 3), (160, 3), (64, 1)], ids=["shrink", "enlarge", "gray"])
def test_cached_images_are_what_ultralytics_loads(small, tmp_path, imgsz, channels):
    for split, augment in (("train", True), ("val", False)):
        cache = build(small, [tmp_path], imgsz, split, channels=channels)
        reference = yolo_dataset(small, split, imgsz, augment=augment, channels=channels)
        cached = yolo_dataset(small, split, imgsz, augment=augment, channels=channels)
        attach_cache(cached, cache)
        for i in range(len(reference)):
            im, hw0, hw = reference.load_image(i)
            im2, hw0_2, hw_2 = cached.load_image(i)
            assert im2.dtype == im.dtype and im2.shape == im.shape and np.array_equal(im2, im), (split, i)
            assert (hw0_2, hw_2) == (hw0, hw) and all(type(v) is int for v in (*hw0_2, *hw_2))


def test_training_and_validation_pipelines_run_on_the_read_only_map(small, tmp_path):
    """Mosaic, MixUp and CopyPaste draw partners from the whole cache (no buffer), and no transform writes into it."""
    cache = build(small, [tmp_path])
    hyp = {"mosaic": 1.0, "mixup": 1.0, "copy_paste": 1.0, "copy_paste_mode": "mixup"}
    train = yolo_dataset(small, "train", 64, augment=True, **hyp)
    attach_cache(train, cache)
    assert not any(m.buffer_enabled for m in datasets._mosaics(train.transforms))
    for i in range(len(train)):
        assert train[i]["img"].shape == (3, 64, 64)  # an empty mosaic buffer would raise here
    assert train.buffer == []

    closed = datasets.with_mosaic_closed(train, get_cfg(overrides=hyp))  # what the workers load the last epochs with
    assert {m.p for m in datasets._mosaics(closed.transforms)} == {0.0}  # MixUp's own partners' Mosaic too
    assert 1.0 in {m.p for m in datasets._mosaics(train.transforms)}  # the earlier epochs' dataset keeps mosaic
    for i in range(len(closed)):
        assert closed[i]["img"].shape == (3, 64, 64)  # served by the same map
    val = yolo_dataset(small, "val", 64, augment=False)
    attach_cache(val, build(small, [tmp_path], split="val"))
    for i in range(len(val)):
        val[i]


def test_attach_refuses_a_dataset_it_cannot_serve(small, tmp_path):
    cache = build(small, [tmp_path])
    with pytest.raises(ValueError, match="at 64px; the dataset loads 3-channel images at 96px"):
        attach_cache(yolo_dataset(small, "train", 96, augment=True), cache)
    with pytest.raises(ValueError, match="cache=False"):
        attach_cache(yolo_dataset(small, "train", 64, augment=True, cache="ram"), cache)
    with pytest.raises(CacheError, match="lacks 6 of the images"):
        attach_cache(yolo_dataset(small, "val", 64, augment=False), cache)


def test_caches_go_to_dev_shm_first_then_to_disk(tmp_path):
    dirs = image_cache_folders.default_dirs(tmp_path)
    assert dirs[-1] == tmp_path
    if Path("/dev/shm").is_dir():
        assert dirs[0] == Path(f"/dev/shm/ddp-launch-{os.getuid()}") and image_cache_folders.in_ram(Path("/dev/shm"))


def test_a_changed_dataset_or_imgsz_gets_its_own_cache(small, tmp_path):
    first = build(small, [tmp_path])
    assert build(small, [tmp_path]).path == first.path
    assert build(small, [tmp_path], imgsz=96).path != first.path
    image = small / "images" / "train" / "000003.jpg"
    st = image.stat()
    try:
        os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert build(small, [tmp_path]).path != first.path
    finally:
        os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns))


# --- one copy per node ----------------------------------------------------------------------------------------------
def _rank(img_path: str, dirs: list[str], barrier, results) -> None:
    """One 'rank': build or open the cache at the same moment as the other, read it all, then measure."""
    logs: list[str] = []
    barrier.wait()
    before = private_kib()
    cache = ensure_cache(img_path, 640, dirs=dirs, threads=1, log=logs.append)
    checksum = touch_all(cache)
    barrier.wait()  # every process has every page mapped now
    mapped = mapping_kib(cache.path)
    private = private_kib() - before
    barrier.wait()  # keep the map until both have measured
    inode = os.stat(cache.path).st_ino
    results.put({"logs": logs, "inode": inode, "checksum": checksum, "mapped": mapped, "private": private})


def _ultralytics_rank(folder: str, barrier, results) -> None:
    """One 'rank' with Ultralytics' own cache='ram'."""
    barrier.wait()
    before = private_kib()
    dataset = yolo_dataset(Path(folder), "train", 640, augment=True, cache="ram")
    barrier.wait()
    results.put(private_kib() - before)
    del dataset


def run_ranks(target, *args, n: int = 2) -> list:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, results), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    out = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return out


@pytest.mark.dist
def test_two_ranks_build_once_and_share_one_copy(photos, shm_dir, tmp_path, record_property):
    img_path = str(photos / "images" / "train")
    ranks = run_ranks(_rank, img_path, [str(shm_dir), str(tmp_path)])

    built = [r for r in ranks if any(" built " in line for line in r["logs"])]
    assert len(built) == 1, [r["logs"] for r in ranks]  # the other one waited at the lock, then mapped the file
    assert len({r["inode"] for r in ranks}) == 1 and len({r["checksum"] for r in ranks}) == 1
    (name,) = cache_files(shm_dir, tmp_path)
    size_kib = os.stat(shm_dir / name).st_size / 1024
    assert os.stat(shm_dir / name).st_blocks * 512 / 1024 == pytest.approx(size_kib, rel=0.02)  # one copy on /dev/shm

    for r in ranks:  # each maps all of it, shares all of it, and is charged half of it
        shared = r["mapped"]["Shared_Clean"] + r["mapped"]["Shared_Dirty"]
        assert r["mapped"]["Rss"] == pytest.approx(size_kib, rel=0.05)
        assert shared == pytest.approx(size_kib, rel=0.05)
        assert r["mapped"]["Pss"] == pytest.approx(size_kib / 2, rel=0.1)
        assert r["private"] < 0.25 * size_kib  # no private copy of the pixels

    alone = ImageCache(shm_dir / name)  # one rank: the same file, all of it charged to the one process
    touch_all(alone)
    pss_alone = mapping_kib(alone.path)["Pss"]
    assert pss_alone == pytest.approx(size_kib, rel=0.05)
    report = {
        "cache_MiB": size_kib / 1024,
        "shared_1rank_MiB": pss_alone / 1024,
        "shared_2ranks_per_rank_MiB": [r["mapped"]["Pss"] / 1024 for r in ranks],
        "shared_2ranks_node_MiB": sum(r["mapped"]["Pss"] for r in ranks) / 1024,
    }
    print(f"\nshared image cache, RAM in MiB: {report}")
    for k, v in report.items():
        record_property(k, v)


@pytest.mark.dist
def test_ultralytics_ram_cache_holds_a_copy_per_rank(photos, record_property):
    """The baseline the shared cache replaces: N ranks, N private copies."""
    files = datasets.split_images(str(photos / "images" / "train"))
    size_kib = sum(load_resized(f, 640)[0].nbytes for f in files) / 1024
    yolo_dataset(photos, "train", 640, augment=True)  # the labels' *.cache, written once before the ranks read it
    # each figure in a fresh process: this one's heap may hold freed pages that a new cache reuses unseen (a CI run
    # measured 220 KiB for a 56 MiB cache here)
    (private_alone,) = run_ranks(_ultralytics_rank, str(photos), n=1)
    ranks = run_ranks(_ultralytics_rank, str(photos))
    for private in (private_alone, *ranks):
        assert private > 0.8 * size_kib
    report = {
        "ultralytics_ram_1rank_MiB": private_alone / 1024,
        "ultralytics_ram_2ranks_per_rank_MiB": [p / 1024 for p in ranks],
        "ultralytics_ram_2ranks_node_MiB": sum(ranks) / 1024,
    }
    print(f"\nUltralytics cache='ram', private RAM in MiB (pixels: {size_kib / 1024:.1f}): {report}")
    for k, v in report.items():
        record_property(k, v)


@pytest.mark.dist
def test_dataloader_workers_map_the_file_instead_of_copying_it(small, tmp_path):
    cache = build(small, [tmp_path], split="val")
    cached = yolo_dataset(small, "val", 64, augment=False)
    attach_cache(cached, cache)
    uncached = yolo_dataset(small, "val", 64, augment=False)
    assert len(pickle.dumps(cached)) < len(pickle.dumps(uncached)) + 1000  # what a spawned worker gets: no pixels

    def batches(dataset, **kwargs):
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, collate_fn=dataset.collate_fn, **kwargs)
        return [b["img"] for b in loader]

    reference = batches(uncached)
    from_workers = batches(cached, num_workers=2, multiprocessing_context="spawn")  # each worker unpickles: maps again
    assert all(torch.equal(a, b) for a, b in zip(reference, from_workers, strict=True))


def test_concurrent_builders_build_once(small, tmp_path):
    logs: list[str] = []
    start = threading.Barrier(4)
    caches = []

    def builder():
        start.wait()
        caches.append(build(small, [tmp_path / "shm", tmp_path / "disk"], log=logs.append))

    threads = [threading.Thread(target=builder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(" built " in line for line in logs) == 1
    assert len({os.stat(c.path).st_ino for c in caches}) == 1
    assert len(cache_files(tmp_path / "shm", tmp_path / "disk")) == 1


# --- damage, failures and clean-up ------------------------------------------------------------------------------------
