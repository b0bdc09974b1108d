"""Ultralytics' datasets as a rank uses them: the augmenting training set, the unaugmented one whose files and labels
the GPU input pipeline reads (loader.augment_on=gpu), the validation loader, a classifier's class folders
(ClassificationDataset, both splits), and the node-shared image cache served through a dataset's own image lists."""

from __future__ import annotations

import math
import re
from copy import copy
from types import SimpleNamespace

import cv2
from ultralytics import __version__ as ULTRALYTICS_VERSION
from ultralytics.data import build_dataloader, build_yolo_dataset
from ultralytics.data.build import seed_worker
from ultralytics.data.augment import Mosaic
from ultralytics.data.base import BaseDataset
from ultralytics.data.dataset import ClassificationDataset, YOLODataset
from ultralytics.data.utils import get_split_fraction
from ultralytics.utils import LOCAL_RANK, LOGGER
from ultralytics.utils.patches import imread
from ultralytics.utils.torch_utils import torch_distributed_zero_first

from launcher.inputs import labels
from launcher.plan.task_rules import rules
from launcher.rank.data import image_cache
from launcher.rank.group.signals import ignore_termination_in_worker

CACHE_RULE = f"ultralytics {ULTRALYTICS_VERSION} load_image"  # what the cached pixels reproduce
# A file Pillow cannot identify makes Ultralytics try the HEIF plugin, so its scan reports the missing plugin
# ("No module named 'pi_heif'") instead of the file's problem; the plan's wording replaces it (inputs/labels.py).
NO_HEIF_PLUGIN = re.compile(r"ignoring corrupt image/label: (?:No module named 'pi_heif'|.*pi-heif.*)$", re.M)


def _plain_drop_reasons(record) -> bool:
    if isinstance(record.msg, str) and "ignoring corrupt image/label" in record.msg:
        record.msg = NO_HEIF_PLUGIN.sub(f"ignoring corrupt image/label: {labels.UNIDENTIFIED}", record.msg)
    return True


LOGGER.addFilter(_plain_drop_reasons)


class ClassFolders(ClassificationDataset):
    """Ultralytics' ClassificationDataset (class folders: its augmentations at imgsz, or its centre crop unaugmented)
    whose items also name their file, `im_file`, as a YOLODataset's do: the loop counts a batch's images by it."""

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "im_file": self.samples[i][0]}


def class_folders(hyp, data: dict, split: str) -> ClassFolders:
    """A classifier's `split` (train: augmented), its classes aligned to the data's names by folder name
    (ClassificationTrainer.build_dataset); local rank 0 writes the split's *.cache first."""
    with torch_distributed_zero_first(LOCAL_RANK):
        return ClassFolders(data[split], hyp, augment=split == "train", prefix=split, names=data["names"])


def train_dataset(hyp, data: dict, batch: int, stride: int):
    """The training set with Ultralytics' augmentation (mosaic, RandomPerspective, HSV, flips; a classifier's:
    class_folders); local rank 0 writes the labels' *.cache first."""
    if rules(hyp.task).folders:
        return class_folders(hyp, data, "train")
    with torch_distributed_zero_first(LOCAL_RANK):
        return build_yolo_dataset(hyp, data["train"], batch, data, mode="train", rect=False, stride=stride)


def raw_train_dataset(hyp, data: dict, batch: int) -> YOLODataset:
    """The training split without Ultralytics' transforms (the GPU input pipeline reads its `labels`, which its
    checks built, with a pose model's keypoints, a segmentation model's polygons or an obb model's corners, and the
    test suite its `load_image`): square, the train split's `fraction` applied, no recent-image buffer filling with
    copies."""
    if hyp.rect:
        raise ValueError("the GPU input pipeline builds square mosaic batches: rect=True is not supported with it")
    with torch_distributed_zero_first(LOCAL_RANK):
        return YOLODataset(
            img_path=data["train"], imgsz=hyp.imgsz, batch_size=batch, augment=False, hyp=hyp, rect=False,
            cache=hyp.cache or None, single_cls=hyp.single_cls or False, stride=32, pad=0.0, prefix="train: ",
            task=hyp.task if hyp.task in ("pose", "segment", "obb") else "detect", classes=hyp.classes, data=data,
            fraction=get_split_fraction(hyp.fraction, "train"),
        )


def val_loader(hyp, data: dict, batch: int, stride: int, workers: int, device, bind=lambda init: init,
               pin_memory: bool = True):
    """Ultralytics' validation loader: rectangular batches of `batch`, sharded over the ranks in contiguous blocks.
    `bind(init)` wraps its workers' init (core binding). `pin_memory=False` for a split read once (the fast
    validator's): pinning allocates page-locked memory batch by batch, a driver call that stalls the training
    steps beside it (slowing them while the split is read ahead)."""
    if rules(hyp.task).folders:
        dataset = class_folders(hyp, data, "val")
    else:
        with torch_distributed_zero_first(LOCAL_RANK):
            dataset = build_yolo_dataset(hyp, data["val"], batch, data, mode="val", rect=True, stride=stride)
    loader = build_dataloader(dataset, batch=batch, workers=workers, shuffle=False, rank=LOCAL_RANK, device=device,
                              pin_memory=pin_memory)
    loader.worker_init_fn = bind(_val_worker_init)  # workers start at the first iteration, with this
    return loader


def start_workers(loader) -> bool:
    """Fork an InfiniteDataLoader's workers now, which Ultralytics does at its first iteration: they read ahead
    (prefetch_factor batches each) while the caller goes on, and its first iteration takes what they have read.
    False, and nothing started, when it has no workers or has started them already."""
    if loader.num_workers == 0 or loader.iterator is not None:
        return False
    loader.iterator = loader._get_iterator()  # what InfiniteDataLoader.__iter__ does first (torch's DataLoader)
    return True


def _val_worker_init(worker_id: int) -> None:
    """Ultralytics' seeding of the validation loader's workers; they survive the rank's SIGTERM (signals.py)."""
    ignore_termination_in_worker()
    seed_worker(worker_id)


def with_mosaic_closed(dataset: YOLODataset, hyp) -> YOLODataset:
    """The dataset as Ultralytics' close_mosaic leaves it (no mosaic, mixup, cutmix or copy-paste), as a second
    dataset: a shallow copy, so both share the labels and the loaded images (the RAM cache, the mosaic buffer)."""
    closed = copy(dataset)
    closed.close_mosaic(hyp=copy(hyp))  # rebuilds the transforms, bound to the copy
    return closed


def set_mosaic_buffer(dataset, enabled: bool) -> None:
    """Ultralytics' Mosaic picks its 3 partner images from a per-worker buffer of recently loaded images (cheap,
    but the picks depend on which worker loaded what). Off: partners come from the whole dataset, so every sample
    is a function of (seed, epoch, index) alone and a resumed run repeats the uninterrupted one exactly."""
    for mosaic in _mosaics(dataset.transforms):
        mosaic.buffer_enabled = enabled


def _mosaics(transform):
    """Every Mosaic in an Ultralytics transform tree: a Compose holds `transforms`, a mix transform `pre_transform`."""
    if isinstance(transform, Mosaic):
        yield transform
    for child in [*(getattr(transform, "transforms", None) or []), getattr(transform, "pre_transform", None)]:
        if child is not None:
            yield from _mosaics(child)


# --- the node-shared image cache (train.cache=shared) --------------------------------------------------------------
def split_images(img_path) -> list[str]:
    """The images of a split (a folder, a .txt list, or a list of them), as a YOLODataset of that split lists them
    (before `fraction`): Ultralytics' own lister, which needs nothing of a dataset but these two attributes."""
    return BaseDataset.get_img_files(SimpleNamespace(prefix="", fraction=1.0), img_path)


def load_resized(path: str, imgsz: int, channels: int = 3):
    """(image, (h0, w0), (h, w)) as `BaseDataset.load_image` returns it for training and validation alike in 8.4:
    long side to imgsz with INTER_LINEAR; None if unreadable."""
    im = imread(path, flags=cv2.IMREAD_COLOR if channels == 3 else cv2.IMREAD_GRAYSCALE)
    if im is None:
        return None, (0, 0), (0, 0)
    h0, w0 = im.shape[:2]
    r = imgsz / max(h0, w0)
    if r != 1:
        w, h = min(math.ceil(w0 * r), imgsz), min(math.ceil(h0 * r), imgsz)
        im = cv2.resize(im, (w, h), interpolation=cv2.INTER_LINEAR)
    if im.ndim == 2:  # cv2.resize drops the channel axis of a one-channel image
        im = im[..., None]
    return im, (h0, w0), im.shape[:2]


def ensure_split_cache(img_path, imgsz: int, *, dirs, channels: int = 3, threads: int | None = None,
                       log=print) -> image_cache.ImageCache:
    """The node's cache of a split at imgsz: mapped if it exists, else built (image_cache.py)."""
    return image_cache.ensure_cache(
        split_images(img_path), imgsz, channels=channels, dirs=dirs, rule=CACHE_RULE,
        load=lambda f: load_resized(f, imgsz, channels), threads=threads, log=log,
    )


class _CachedList:
    """Stands in for one of BaseDataset's per-image lists (ims, im_hw0, im_hw): part 0, 1 or 2 of `cache.image`."""

    def __init__(self, cache: image_cache.ImageCache, rows, part: int):
        self.cache, self.rows, self.part = cache, rows, part

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.cache.image(self.rows[i])[self.part]


def attach_cache(dataset: BaseDataset, cache: image_cache.ImageCache) -> None:
    """Serve a YOLODataset's images from `cache`: no decoding, no per-rank copy. Build the dataset with cache=False.

    Uses the contract of Ultralytics' own cache='ram': `load_image` returns `ims[i]`, `im_hw0[i]`, `im_hw[i]` as they
    are when the dataset's `cache` is "ram", keeps no mosaic buffer, and every Mosaic built then (close_mosaic rebuilds
    them) draws its partners from the whole dataset. The Mosaics built before this call are switched over here.
    """
    if type(dataset).load_image is not BaseDataset.load_image:
        raise TypeError(f"{type(dataset).__name__} overrides load_image: the cache holds BaseDataset.load_image's images")
    if dataset.cache is not None:
        raise ValueError(f"the dataset already caches its images (cache={dataset.cache!r}): build it with cache=False")
    if (dataset.imgsz, dataset.channels) != (cache.imgsz, cache.channels):
        raise ValueError(
            f"{cache.path} holds {cache.channels}-channel images at {cache.imgsz}px; "
            f"the dataset loads {dataset.channels}-channel images at {dataset.imgsz}px"
        )
    rows = cache.rows(dataset.im_files)
    dataset.ims, dataset.im_hw0, dataset.im_hw = (_CachedList(cache, rows, part) for part in range(3))
    dataset.buffer.clear()
    dataset.cache = "ram"
    set_mosaic_buffer(dataset, False)
