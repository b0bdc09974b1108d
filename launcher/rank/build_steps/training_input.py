"""What a rank trains on, built from the plan in components.Rank's order (its steps 1 and 4):

- `image_caches`: the node-shared image caches (train.cache=shared), before the process group;
- `bind_cores`: this process on its own cores, its loader workers on the others (loader.bind_cores);
- `training_set`: Ultralytics' augmenting training set (loader.augment_on=cpu), or the files' bytes and labels with
  the GpuInput that decodes and augments them on the device (gpu; a classifier's: ClassifyInput);
- `train_loader`: the DataLoader that serves every epoch, mosaic closed by each batch's epoch;
- `train_inputs`: the sampler of this rank's shard, and the loop's batches over train_loader.
"""

from __future__ import annotations

from pathlib import Path

import torch

from launcher.plan.plan import LaunchPlan
from launcher.plan.settings import Settings
from launcher.plan.task_rules import rules
from launcher.rank.data import affinity, image_cache, image_cache_folders
from launcher.rank.data.encoded import EncodedImages, EncodedTrainDataset, outlined
from launcher.rank.data.pipeline import TrainInputs
from launcher.rank.data.sampler import EpochBatchSampler, EpochSeededDataset, worker_init
from launcher.rank.gpu_data.augment_obb import OBB_CORNERS
from launcher.rank.gpu_data.augment_segments import SEGMENT_POINTS
from launcher.rank.gpu_data.classify_augment import ClassifyAugment
from launcher.rank.gpu_data.classify_input import ClassifyInput, class_folder_images
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from launcher.rank.gpu_data.gpu_input import Decoder, GpuInput, buffer_capacity
from launcher.rank.ultralytics import datasets


def image_caches(settings: Settings, plan: LaunchPlan, data: dict, imgsz: int,
                 log) -> dict[str, image_cache.ImageCache]:
    """Both splits' caches (held for the whole run: a cache in use is never evicted): the first process on the
    node builds them with every core while the others wait at a file lock. With the input on the GPU the
    training split's cache holds the files' bytes (compressed: a fraction of the decoded size). `imgsz`: the plan
    checked it, a multiple of the largest stride."""
    dirs = image_cache_folders.default_dirs(Path(settings.paths.cache).expanduser() / "images")
    gpu = plan.augment_on == "gpu"
    caches = {split: datasets.ensure_split_cache(data[split], imgsz, dirs=dirs, channels=data.get("channels", 3),
                                                 log=log)
              for split in (("val",) if gpu else ("train", "val"))}
    if gpu:
        caches["train"] = image_cache.ensure_file_cache(datasets.split_images(data["train"]), dirs=dirs, log=log)
    return caches


def bind_cores(settings: Settings, plan: LaunchPlan, device: torch.device, local_rank: int,
               detail) -> affinity.CoreSplit | None:
    """loader.bind_cores on a GPU node: this process on its own cores, its loader workers on the others (said through
    `detail`, the rank log's diagnostics)."""
    if not settings.loader.bind_cores or device.type != "cuda":
        return None
    split = affinity.split_cores(affinity.available_cores(), local_rank, plan.nproc_per_node, plan.workers_per_rank)
    if split is not None:
        affinity.bind_process(split.main)
        detail(f"cores: training process on {affinity.core_list(split.main)}, loader workers on "
               f"{affinity.core_list(split.workers)}")
    return split


def on_worker_cores(cores: affinity.CoreSplit | None, inner):
    """A loader's worker_init_fn that first moves the worker onto the workers' cores (when bind_cores split them)."""
    return affinity.BindWorker(cores.workers, inner) if cores else inner


def training_set(settings: Settings, plan: LaunchPlan, hyp, data: dict, device: torch.device, *, caches: dict,
                 stride: int, close_at: int | None, input_dtype: torch.dtype, log, detail=None):
    """(dataset, gpu_input): Ultralytics' augmenting training set and None (loader.augment_on=cpu), or the files'
    bytes and labels and the GpuInput that decodes and augments them on `device` (gpu; on the CPU the same tensor
    maths, computed by the training process). `log` warns; `detail` (default `log`) takes the diagnostics."""
    if plan.augment_on == "gpu":
        if device.type != "cuda":
            (detail or log)("loader.augment_on=gpu on the CPU: the same tensor maths, computed by the training process")
        if rules(plan.task).folders:  # a classifier's class folders: their own augmentation (classify_input.py)
            return class_folders_on_gpu(hyp, data, device, input_dtype, log)
        inner = datasets.raw_train_dataset(hyp, data, plan.batch_per_rank)  # labels, checks
        obb = getattr(inner, "use_obb", False)  # an obb dataset's corners travel as its rows' outlines
        # polygons travel with their rows: a segmentation dataset's, and a detection dataset's, whose boxes they make
        outlines = OBB_CORNERS if obb else SEGMENT_POINTS if outlined(inner) else 0
        images = EncodedImages.of(inner, segment_points=outlines)
        dataset = EncodedTrainDataset(images, labels=inner.labels, decode_all=device.type != "cuda",
                                      cache=caches.get("train"))
        pose = getattr(inner, "use_keypoints", False)  # a pose dataset's keypoints travel with its boxes
        augment = GpuAugment(inner.imgsz, hyp, out_dtype=input_dtype, keypoints=data["kpt_shape"][0] if pose else 0,
                             flip_idx=data.get("flip_idx") if pose else (), segments=outlines,
                             masks=getattr(inner, "use_segments", False), obb=obb)
        gpu_input = GpuInput(augment, Decoder(device, images.files, log), device=device,
                             capacity=buffer_capacity(len(images), plan.batch_per_rank), close_at=close_at,
                             partners_from_batch=not settings.loader.mosaic_buffer)
        return dataset, gpu_input
    dataset = datasets.train_dataset(hyp, data, plan.batch_per_rank, stride)
    if "train" in caches:
        datasets.attach_cache(dataset, caches["train"])
    if not settings.loader.mosaic_buffer and rules(plan.task).mosaic:
        datasets.set_mosaic_buffer(dataset, False)
    return dataset, None


def class_folders_on_gpu(hyp, data: dict, device: torch.device, input_dtype: torch.dtype, log):
    """(dataset, gpu_input) of a classifier on the GPU input: the files ClassificationDataset checked, read as bytes,
    and the ClassifyInput that decodes them and applies Ultralytics' classification transforms on `device`."""
    images = class_folder_images(datasets.class_folders(hyp, data, "train").samples)
    dataset = EncodedTrainDataset(images, decode_all=device.type != "cuda")
    augment = ClassifyAugment(int(hyp.imgsz), hyp, out_dtype=input_dtype)
    return dataset, ClassifyInput(augment, Decoder(device, images.files, log), device=device)


def train_loader(settings: Settings, plan: LaunchPlan, dataset, sampler: EpochBatchSampler, hyp,
                 device: torch.device, *, gpu_input: GpuInput | None, close_at: int | None,
                 cores: affinity.CoreSplit | None):
    """The workers serve every epoch; from epoch close_at on they load without mosaic (Ultralytics' close_mosaic),
    the GPU input by the batch's epoch (GpuInput.mosaic), Ultralytics' transforms from a closed copy."""
    workers = plan.workers_per_rank
    served = dataset
    if gpu_input is None:
        closed = datasets.with_mosaic_closed(dataset, hyp) if close_at is not None else None
        served = EpochSeededDataset(dataset, int(settings.seed), closed=closed, close_at=close_at)
    return torch.utils.data.DataLoader(
        served,
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=bool(settings.loader.pin_memory) and device.type == "cuda",
        collate_fn=getattr(dataset, "collate_fn", None),  # a classifier's {img, cls}: torch's default
        worker_init_fn=on_worker_cores(cores, worker_init),
        prefetch_factor=int(settings.loader.prefetch_factor) if workers else None,
    )


def train_inputs(settings: Settings, plan: LaunchPlan, dataset, hyp, device: torch.device, *, rank: int,
                 world_size: int, gpu_input: GpuInput | None, close_at: int | None, cores: affinity.CoreSplit | None,
                 prepare) -> tuple[EpochBatchSampler, TrainInputs]:
    """(sampler, the loop's batches): this rank's shard of every epoch (every step the graph's shape when CUDA
    graphs fill the last batch), served by train_loader and made ready for the step by `prepare`."""
    ddp = plan.mode == "ddp"
    sampler = EpochBatchSampler(len(dataset), plan.batch_per_rank, num_replicas=world_size if ddp else 1,
                                rank=rank if ddp else 0, seed=int(settings.seed),
                                fill_last=bool(plan.cuda_graphs) and device.type == "cuda")
    loader = train_loader(settings, plan, dataset, sampler, hyp, device, gpu_input=gpu_input, close_at=close_at,
                          cores=cores)
    ahead = bool(settings.loader.fetch_ahead)
    inputs = TrainInputs(loader, sampler, device, prepare, decode=gpu_input.decoded if gpu_input is not None else None,
                         fetch_ahead=ahead, persistent=bool(settings.loader.persistent_workers),
                         background=gpu_input is not None and ahead)
    return sampler, inputs
