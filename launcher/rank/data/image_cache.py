"""A node-wide image cache: every image of a split decoded once into one file that all ranks and workers map (or,
for the GPU input pipeline, every file's bytes as they are: `ensure_file_cache`).

Ultralytics' `cache='ram'` decodes the whole split in every rank: 8 ranks, 8 copies. Here the decoded images live in
one file on the node -- in /dev/shm when it has room, else in a folder on disk -- and every rank and every DataLoader
worker maps it read-only, so the kernel holds one copy that all of them share.

The file: a fixed header, a JSON block (the image list, imgsz, channels, the key), the pixels of every image packed
back to back (BGR uint8, H x W x C, resized exactly as `BaseDataset.load_image` resizes for training), then an index
of one row per image: (offset, h0, w0, h, w); a row of zeros marks an image that could not be decoded. A checksum
covers the JSON and the index, not the pixels (that would mean reading the whole file at every open): a cache is
only ever published complete, so what can go wrong is truncation or damage to its layout, and both are detected.

* Name. `images-<imgsz>px-<digest>.bin`, the digest taken over the image paths with their sizes and mtimes, imgsz,
  channels and the decoding rule (`rule`: the Ultralytics release whose load_image the pixels reproduce): a changed
  dataset gets a new cache, and runs of the same data share one. What an image decodes to is the caller's `load`
  (rank/ultralytics/datasets.py: Ultralytics' load_image rule, the same for training and validation in 8.4).
* Location. The first of `dirs` with room (default_dirs: /dev/shm/ddp-launch-<uid>, then a folder on disk). Room is
  half of the free space, and on a RAM-backed filesystem also half of the available memory: DataLoader batches and
  NCCL use /dev/shm too, and the training processes need RAM. With no room anywhere the build fails naming the sizes.
* Building. Under an exclusive lock on `dirs[0]/.lock`, so concurrent builders (the ranks of a node, or two jobs)
  build once: the others wait at the lock, then map the file. Threads decode and write images at once (OpenCV
  releases the GIL, so they use every core; no worker start-up, no pixels sent between processes, safe inside a
  rank). The build writes a temporary file and renames it into place: a cache is complete or absent. A failed build
  deletes its temporary file; one left by a killed builder is deleted by the next build in that folder.
* Clean-up. A cache outlives the run (the next run with the same data and imgsz maps it at once). Every reader holds
  a shared lock on the file while it maps it; `remove_unused` (image_cache_folders.py: the folders, their room,
  lock and clean-up) deletes the caches nobody holds (`ddp-env --clear-cache`). A build that lacks room first removes the unused caches of that folder. Files in /dev/shm use RAM
  until removed or the node reboots. Folders and files are the user's alone (0700, 0600).
* Who builds. Whoever asks first: `ensure_cache` in every rank finds the cache or builds it (the first process on
  the node builds with all cores, the others wait at the lock). Call it before the process group exists when a
  build may take longer than dist.timeout_s, so that no rank waits for it in a barrier.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from launcher.rank.data import image_cache_folders as folders

FORMAT = 1
MAGIC = b"DDPIMC01"
HEADER = struct.Struct("<8sQQQI")  # magic, JSON length, index offset, file size, crc32 of JSON + index
ROW = 5  # index columns: offset, h0, w0, h, w
SIZE_SAMPLE = 32  # images decoded to estimate the size of a cache before building it
CHUNK = 16  # images per build task: few enough tasks for a million images, little left to finish when one fails
PROGRESS_EVERY_S = 30.0
FILE_BYTES = "file bytes"  # the rule of a cache of files as they are on disk (ensure_file_cache)


class CacheError(RuntimeError):
    """A cache file that cannot be used (damaged, or for other images), or a cache that cannot be built."""


Log = Callable[[str], None]
Shape = tuple[int, int]  # (height, width)


# --- what a cache holds ---------------------------------------------------------------------------------------------
Load = Callable[[str], tuple]  # path -> (image or None when unreadable, (h0, w0), (h, w))


def cache_key(files: Sequence[str], imgsz: int, channels: int, rule: str) -> str:
    """Digest of everything the cached pixels depend on."""
    h = hashlib.sha256(json.dumps({"format": FORMAT, "rule": rule, "imgsz": imgsz, "channels": channels}).encode())
    for f in files:
        st = os.stat(f)
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def cache_name(key: str, imgsz: int) -> str:
    return f"images-{imgsz}px-{key[:16]}.bin" if imgsz else f"files-{key[:16]}.bin"




# --- reading --------------------------------------------------------------------------------------------------------
class ImageCache:
    """A cache file mapped read-only. `image(i)` returns a view into the map: no copy, no decode.

    Pickling sends only the path: a DataLoader worker started by spawn maps the same file again, and one started by
    fork inherits the map. Either way the pixels are the kernel's one copy, shared by every process on the node.
    """

    def __init__(self, path: str | Path, key: str | None = None):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # "in use": remove_unused() leaves this file alone
            if os.fstat(f.fileno()).st_nlink == 0:
                raise CacheError(f"{self.path} was removed while it was being opened")
            try:
                # mmap keeps a duplicate of the descriptor, and with it the lock, for as long as the map lives.
                self._map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            except ValueError as e:  # an empty file
                raise CacheError(f"{self.path} is empty") from e
        self._read_layout(key)

    def _read_layout(self, key: str | None) -> None:
        m, size = self._map, len(self._map)
        if size < HEADER.size:
            raise CacheError(f"{self.path} is truncated ({size} bytes)")
        magic, meta_len, index_offset, expected, crc = HEADER.unpack_from(m, 0)
        if magic != MAGIC:
            raise CacheError(f"{self.path} is not an image cache of this format")
        if size != expected:
            raise CacheError(f"{self.path} is truncated or damaged: {size} bytes, its header says {expected}")
        meta_bytes = m[HEADER.size : HEADER.size + meta_len]
        if zlib.crc32(m[index_offset:size], zlib.crc32(meta_bytes)) != crc:
            raise CacheError(f"{self.path}: its header or index does not match its checksum")
        meta = json.loads(meta_bytes)
        if meta["format"] != FORMAT or (key is not None and meta["key"] != key):
            raise CacheError(f"{self.path} holds other images (format {meta['format']}, key {meta['key'][:16]})")
        self.key, self.imgsz, self.channels, self.files = meta["key"], meta["imgsz"], meta["channels"], meta["files"]
        n = len(self.files)
        if index_offset + n * ROW * 8 != size:
            raise CacheError(f"{self.path}: the index does not fit the file")
        self._index = np.frombuffer(m, np.int64, count=n * ROW, offset=index_offset).reshape(n, ROW)
        offsets, nbytes = self._index[:, 0], self._index[:, 3] * self._index[:, 4] * self.channels
        stored = nbytes > 0
        if np.any(offsets[stored] < HEADER.size + meta_len) or np.any(offsets[stored] + nbytes[stored] > index_offset):
            raise CacheError(f"{self.path}: the index points outside the pixel data")
        self._pixels = np.frombuffer(m, np.uint8)  # read-only: a transform writing into an image fails loudly
        self._rows: dict[str, int] | None = None

    def __reduce__(self):
        return ImageCache, (str(self.path), self.key)

    def __len__(self) -> int:
        return len(self.files)

    @property
    def nbytes(self) -> int:
        return len(self._map)

    def image(self, i: int) -> tuple[np.ndarray, Shape, Shape]:
        """(image, (h0, w0), (h, w)) of row i, as `BaseDataset.load_image` returns them; the image: a read-only view."""
        offset, h0, w0, h, w = self._index[i].tolist()
        if h == 0:
            raise CacheError(f"{self.files[i]} could not be decoded when {self.path} was built")
        im = self._pixels[offset : offset + h * w * self.channels].reshape(h, w, self.channels)
        return im, (h0, w0), (h, w)

    def rows(self, files: Sequence[str]) -> np.ndarray:
        """The cache rows of `files`, in their order; every one must be in the cache and decodable."""
        if self._rows is None:
            self._rows = {f: i for i, f in enumerate(self.files)}
        rows = np.array([self._rows.get(f, -1) for f in files], dtype=np.int64)
        missing = [f for f, r in zip(files, rows) if r < 0]
        if missing:
            raise CacheError(f"{self.path} lacks {len(missing)} of the images asked for, e.g. {missing[0]}")
        unreadable = [f for f, r in zip(files, rows) if self._index[r, 3] == 0]
        if unreadable:
            raise CacheError(f"{self.path}: {len(unreadable)} of the images asked for did not decode, e.g. {unreadable[0]}")
        return rows


# --- building -------------------------------------------------------------------------------------------------------
def ensure_cache(
    files: Sequence[str],
    imgsz: int,
    *,
    load: Load,
    rule: str,
    channels: int = 3,
    dirs: Sequence[str | Path],
    threads: int | None = None,
    log: Log = print,
) -> ImageCache:
    """The cache of `files`, each as `load(path)` returns it at imgsz: mapped if it exists, else built first (the
    key covers `rule`, what `load` does). Safe to race."""
    if not isinstance(imgsz, int) or channels not in (1, 3) or (imgsz == 0) != (rule == FILE_BYTES):
        raise ValueError(f"the image cache takes an int imgsz and 1 or 3 channels, not {imgsz!r} and {channels}")
    dirs = [Path(d) for d in dirs]
    files = list(files)
    key = cache_key(files, imgsz, channels, rule)
    name = cache_name(key, imgsz)
    cache = _open_existing(dirs, name, key)
    if cache is None:
        with folders.build_lock(dirs[0], log):
            cache = _open_existing(dirs, name, key, log)  # built while we waited, or damaged: then removed
            if cache is None:
                for d in dirs:
                    folders.remove_dead_temps(d)
                need = _estimate_size(files, load)
                target = _pick_dir(dirs, need, log)
                threads = max(1, min(threads or len(os.sched_getaffinity(0)), len(files)))
                verb = "copying" if rule == FILE_BYTES else "decoding"
                log(f"image cache: {verb} {len(files)} images (~{_size(need)}) into {target}: {threads} threads")
                _build(files, load, (imgsz, channels, rule), key, target / name, threads, log)
                cache = ImageCache(target / name, key)
    what = f"at {imgsz}px" if imgsz else "as files"
    log(f"image cache: {len(cache)} images {what}, {_size(cache.nbytes)}, mapped from {cache.path}")
    return cache


def ensure_file_cache(files: Sequence[str], *, dirs: Sequence[str | Path], threads: int | None = None,
                      log: Log = print) -> ImageCache:
    """The cache of `files`' bytes, undecoded (the GPU input pipeline decodes them): row i is a (1, n, 1) view of
    file i's n bytes. The same file format, lock and clean-up as the decoded caches; imgsz 0 names it."""
    return ensure_cache(files, 0, load=_file_bytes, rule=FILE_BYTES, channels=1, dirs=dirs, threads=threads, log=log)


def _file_bytes(path: str):
    try:
        data = np.fromfile(path, np.uint8)
    except OSError:
        return None, (0, 0), (0, 0)
    return data.reshape(1, -1, 1), (0, 0), (1, len(data))


def _open_existing(dirs: Sequence[Path], name: str, key: str, log: Log | None = None) -> ImageCache | None:
    """The valid cache `name` in one of `dirs`, or None. With `log` (the lock held), a damaged one is removed."""
    for d in dirs:
        try:
            return ImageCache(d / name, key)
        except FileNotFoundError:
            continue
        except CacheError as e:
            if log is not None:
                log(f"image cache: {e}; building it again")
                (d / name).unlink(missing_ok=True)
    return None


def _estimate_size(files: Sequence[str], load: Load) -> int:
    """Bytes of the cache, from the mean size of up to SIZE_SAMPLE images spread over the split."""
    sample = files[:: max(1, len(files) // SIZE_SAMPLE)][:SIZE_SAMPLE]
    sizes = [im.nbytes for im, _, _ in map(load, sample) if im is not None]
    return int(np.mean(sizes) * len(files)) if sizes else 0


def _pick_dir(dirs: Sequence[Path], need: int, log: Log) -> Path:
    """The first folder with room for `need` bytes, after removing its unused caches if that makes room."""
    for d in dirs:
        folders.private_dir(d)
        if folders.room(d) < need:
            for path in folders.remove_unused(d):
                log(f"image cache: removed the unused cache {path} to make room")
        if folders.room(d) >= need:
            return d
        log(f"image cache: {d} has room for {_size(folders.room(d))}, the cache needs ~{_size(need)}")
    raise CacheError(
        f"no room for an image cache of ~{_size(need)} in {', '.join(map(str, dirs))} (a cache may take half "
        "of the free space, and half of the available RAM on tmpfs): free some space, or choose another cache folder"
    )


def _build(files: Sequence[str], load: Load, what: tuple[int, int, str], key: str, path: Path, threads: int,
           log: Log) -> None:
    """Decode every image into a temporary file beside `path`, then rename it to `path`."""
    imgsz, channels, rule = what
    meta = {"format": FORMAT, "key": key, "imgsz": imgsz, "channels": channels, "rule": rule}
    meta = json.dumps({**meta, "files": list(files)}).encode()
    index = np.zeros((len(files), ROW), np.int64)  # rows of undecodable images stay zero
    end = HEADER.size + len(meta)  # where the next image goes; images land in the order the threads finish them
    claim = threading.Lock()
    pool = ThreadPoolExecutor(threads)  # starts no thread before the first submit
    tmp = path.with_name(f".{path.name}.{os.getpid()}@{socket.gethostname()}.tmp")  # see folders.remove_dead_temps
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, folders.FILE_MODE)

    def store(rows: range) -> int:
        nonlocal end
        for i in rows:
            im, hw0, hw = load(files[i])
            if im is None:
                continue
            with claim:
                offset, end = end, end + im.nbytes
            _pwrite_all(fd, im, offset)  # outside the lock: the threads write their images in parallel
            index[i] = (offset, *hw0, *hw)
        return len(rows)

    start = last = time.monotonic()
    try:
        chunks = [pool.submit(store, range(s, min(s + CHUNK, len(files)))) for s in range(0, len(files), CHUNK)]
        done = 0
        for chunk in as_completed(chunks):
            done += chunk.result()
            if time.monotonic() - last > PROGRESS_EVERY_S:
                last = time.monotonic()
                log(f"image cache: {done}/{len(files)} images")
        pool.shutdown()
        index_offset = -(-end // 8) * 8  # 8-byte aligned, for the int64 index
        size = index_offset + index.nbytes
        _pwrite_all(fd, index, index_offset)
        _pwrite_all(fd, meta, HEADER.size)
        crc = zlib.crc32(index.tobytes(), zlib.crc32(meta))
        _pwrite_all(fd, HEADER.pack(MAGIC, len(meta), index_offset, size, crc), 0)  # last: a valid header means done
        os.fsync(fd)  # on disk: the data is written before the name appears (on tmpfs a no-op)
        os.rename(tmp, path)
    except BaseException as e:
        pool.shutdown(cancel_futures=True)  # waits for the chunks being decoded: nothing writes to fd once it is closed
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CacheError(
                f"{path.parent} ran out of space while the image cache was written: free some space there, "
                "or choose another cache folder"
            ) from e
        raise
    finally:
        os.close(fd)
    unreadable = [f for f, row in zip(files, index) if row[3] == 0]
    if unreadable:
        log(f"image cache: {len(unreadable)} image(s) could not be decoded and are not cached, e.g. {unreadable[0]}")
    took = time.monotonic() - start
    log(f"image cache: built {path} in {took:.1f} s ({len(files) / max(took, 1e-9):.0f} images/s)")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of `data` (bytes or a C-contiguous array) at `offset`: pwrite may write less than asked."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


