"""The one module that drives Ultralytics' trainer: a DetectionTrainer running in-process inside a torchrun rank.

Ultralytics keeps the model, the loss, the datasets, the validator, EMA, the optimizer's parameter groups and the
checkpoint format (weights stay loadable with `YOLO("best.pt")`). ddp-launch replaces the parts that are wrong
or opaque under an external torchrun (../shared/notes/ultralytics-8.4.md):

* world size, rank and device from torchrun's environment, not from the device string (multi-node, CPU);
* the process group is ours: backend from the plan, timeout `dist.timeout_s` (not 3 hours);
* DDP without find_unused_parameters, device_ids only on CUDA, gradients in the all-reduce buckets; a loss normalised
  over the global batch (loss_sync.py); a store prefix per restart attempt; a heartbeat that names a hung rank;
* the training loader: a DistributedSampler whose epoch is set when the loader reaches that epoch (sampler.py);
* the update: loss scaled so lr0 means one thing (lr.py), no hidden accumulation or weight-decay rescaling;
* validation every `val_interval` epochs, decided the same way on every rank;
* no AMP check (it downloads weights); a steady-state throughput meter; atomic checkpoints; summary.json.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import time
import warnings
from copy import deepcopy
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from launcher import affinity
from launcher import checkpoint as ckptio
from launcher import image_cache
from launcher import lr as lrmod
from launcher.fast_loss import MAX_TARGETS, make_sync_free, max_targets_per_image
from launcher.fast_step import compiled, fused_optimizer
from launcher.faults import FaultInjector
from launcher.gpu_monitor import GpuMonitor
from launcher.graphed import GraphedDetector
from launcher.loss_sync import use_global_normaliser
from launcher.meter import StepMeter
from launcher.plan import LaunchPlan
from launcher.sampler import EpochBatchSampler, EpochSeededDataset, sample_seed, worker_init
from launcher.shutdown import StopSignal
from launcher.watchdog import Heartbeat

from ultralytics import __version__ as ULTRALYTICS_VERSION  # noqa: E402  (env is set: imported by the worker)
from ultralytics.models.yolo.detect import DetectionTrainer
from ultralytics.utils import LOCAL_RANK as UL_LOCAL_RANK
from ultralytics.utils import LOGGER
from ultralytics.utils.checks import check_imgsz
from ultralytics.utils.torch_utils import (
    TORCH_2_13,
    EarlyStopping,
    ModelEMA,
    convert_optimizer_state_dict_to_fp16,
    strip_optimizer,
    torch_distributed_zero_first,
    unwrap_model,
)

OPTIMIZER_NAMES = {"sgd": "SGD", "adamw": "AdamW"}
INPUT_BOUND = 0.10  # data wait above this share of step time: the GPU is starved
# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (the old name warns); the GPU machines run 2.11.
BUFFER_SYNC_KWARG = "forward_sync_buffers" if TORCH_2_13 else "broadcast_buffers"


class DistributedInitError(RuntimeError):
    """DDP could not start (rendezvous, NCCL): with mode=auto and dist.fallback=dp the launcher retries with DP."""


def attempt_store(timeout: timedelta):
    """torchrun's store, under a prefix for this restart attempt.

    After a restart the agent's store still holds the previous attempt's keys (gloo's peer addresses, ...), and a
    fast rank can read a dead peer's address before the slow one rewrites it. A prefix per attempt keeps them apart.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, _, world = rank_info()
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
    base = dist.TCPStore(addr, port, world, is_master=not agent_hosts and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"ddp_launch/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


def rank_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def ultralytics_args(cfg: dict, plan: LaunchPlan, run_dir: Path) -> dict:
    """The Ultralytics train arguments for this run (what `yolo train` would be given)."""
    train, optim, model = cfg["train"], cfg["optim"], cfg["model"]
    _, local_rank, _ = rank_info()
    weights, arch = model.get("weights"), model.get("cfg")
    args = {
        "model": arch or weights,
        "pretrained": weights if (arch and weights) else False,
        "data": str(cfg["data"]["path"]),
        "epochs": train["epochs"],
        "imgsz": train["imgsz"],
        "batch": plan.global_batch,
        "nbs": plan.global_batch,  # Ultralytics' accumulation and weight-decay rescaling off: see lr.py
        "device": "cpu" if plan.device == "cpu" else str(local_rank),
        "workers": plan.workers_per_rank,
        "optimizer": OPTIMIZER_NAMES[str(optim["name"]).lower()],
        "lr0": plan.lr0,
        "lrf": optim["lrf"],
        "momentum": optim["momentum"],
        "weight_decay": optim["weight_decay"],
        "warmup_epochs": plan.warmup_epochs or 0.0,
        "warmup_momentum": optim["warmup_momentum"],
        "warmup_bias_lr": optim["warmup_bias_lr"],
        "cos_lr": optim["cos_lr"],
        "amp": train["amp"] if plan.device == "cuda" else False,
        "cache": False if train["cache"] == "shared" else train["cache"],  # shared: ddp-launch's node cache
        "close_mosaic": train["close_mosaic"],
        "patience": train["patience"],
        "save_period": train["save_period"],
        "seed": cfg["seed"],
        "save_dir": str(run_dir),
        "exist_ok": True,
        "val": True,
        "plots": False,
        "verbose": True,
    }
    args.update(train.get("extra") or {})
    return args


def train_step(model, batch: dict, *, loss_scale: float, optimizer, scaler, grad_clip: float, amp_dtype=None):
    """One optimizer step: forward, loss, backward, unscale, clip, step. Returns (loss, loss items).

    `loss_scale` turns the rank's summed loss into base_batch x its mean (lr.loss_scale), so DDP's gradient average
    is the same update a single process would take on the whole global batch.
    """
    device_type = next(model.parameters()).device.type
    # cache_enabled=False: CUDA graphs replay casts they captured; a cache would hold tensors across steps
    with torch.autocast(device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None, cache_enabled=False):
        # Forward on the images only, loss on the unwrapped model: DataParallel may scatter the images but not
        # the batch's per-object tensors (batch_idx, cls, bboxes), and DDP hooks the gradients either way.
        preds = model(batch["img"])
        loss, items = unwrap_model(model).loss(batch, preds)
        loss = loss.sum() * loss_scale
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.detach(), items


def set_mosaic_buffer(dataset, enabled: bool) -> None:
    """Ultralytics' Mosaic picks its 3 partner images from a per-worker buffer of recently loaded images (cheap,
    but the picks depend on which worker loaded what). Off: partners come from the whole dataset, so every sample
    is a function of (seed, epoch, index) alone and a resumed run repeats the uninterrupted one exactly."""
    from ultralytics.data.augment import Mosaic

    stack = [dataset.transforms]
    while stack:
        t = stack.pop()
        if isinstance(t, Mosaic):
            t.buffer_enabled = enabled
        stack.extend(getattr(t, "transforms", []) or [])
        if getattr(t, "pre_transform", None) is not None:
            stack.append(t.pre_transform)


def prepare_criterion(model, sync_free: bool = True) -> None:
    """Build the model's loss now (Ultralytics builds it lazily), without host syncs (fast_loss.py) if asked, and
    normalise it over the global batch."""
    m = unwrap_model(model)
    m.criterion = m.init_criterion()
    if sync_free and not make_sync_free(m.criterion):
        LOGGER.warning(f"{type(m.criterion).__name__}: train.sync_free_loss applies to detection losses; this one syncs")
    if not use_global_normaliser(m.criterion):
        LOGGER.warning(f"{type(m.criterion).__name__}: loss normalised per rank (not a YOLO detection loss)")


class LaunchTrainer(DetectionTrainer):
    """Ultralytics' DetectionTrainer with ddp-launch's distributed setup, loader, update rule and loop."""

    def __init__(self, cfg: dict, plan: LaunchPlan, run_dir: Path):
        self.cfg, self.plan, self.run_dir = cfg, plan, Path(run_dir)
        self.rank, self.local_rank, world = rank_info()
        csv = Path(run_dir) / "results.csv"
        # Ultralytics' constructor deletes results.csv (exists(), then unlink()): a resume restores it from here
        self._results_before = csv.read_text() if self.rank == 0 and csv.exists() else None
        args = ultralytics_args(cfg, plan, run_dir)
        if self.rank != 0:
            # Every rank running that deletion races the others for the file (the loser fails with FileNotFoundError)
            # and may delete it before rank 0 has read it. The other ranks construct on a folder without one (it is
            # never created: Ultralytics writes only on rank 0), then take the run folder's paths.
            args["save_dir"] = str(Path(run_dir) / "ranks" / f"construct-rank{self.rank}")
        super().__init__(overrides=args)
        if self.rank != 0:
            self.save_dir = Path(run_dir)
            self.args.save_dir = str(run_dir)
            self.wdir = self.save_dir / "weights"
            self.last, self.best, self.csv = self.wdir / "last.pt", self.wdir / "best.pt", self.save_dir / "results.csv"
        self.world_size = world  # Ultralytics derives it from the device string: 1 per rank, 0 on the CPU
        self.use_ddp = plan.mode == "ddp"
        torch.set_num_threads(plan.threads_per_rank)  # Ultralytics' select_device reset it
        self.val_interval = int(cfg["train"]["val_interval"])
        self.log_every = int(cfg.get("log", {}).get("interval_steps", 20))
        self.record_samples = bool(cfg.get("debug", {}).get("record_samples"))
        self.validated_epochs: list[int] = []
        self.samples_seen: dict[int, list[str]] = {}
        self.fitness_epoch: int | None = None  # the epoch best.pt holds
        self.start_batch = 0  # resuming mid-epoch: the first batch of start_epoch to train
        self.tloss_steps = 0  # steps in the running mean self.tloss
        self.resumed_from: Path | None = None
        self.stop_signal = StopSignal()
        self.control_group = None
        self.heartbeat = None
        self.faults = FaultInjector.from_env(self.rank)
        self._ahead: tuple[dict, torch.cuda.Event | None] | None = None  # the next batch, fetched during this step
        self._copy_stream = None  # CUDA: the side stream that batches fetched ahead are copied on

    # --- setup ----------------------------------------------------------------------------------------------
    def _setup_ddp(self):
        """Our process group: env:// rendezvous from torchrun, the plan's backend, a bounded timeout."""
        if self.plan.device == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        try:
            self.faults.at_init()
            # The watchdog names a hung rank after dist.timeout_s; the collectives' own timeout comes later.
            timeout = timedelta(seconds=self.plan.timeout_s + max(30, self.plan.timeout_s // 2))
            dist.init_process_group(
                backend=self.plan.backend, store=attempt_store(timeout), rank=self.rank, world_size=self.world_size, timeout=timeout
            )
            dist.barrier()  # the group really works (NCCL communicators are created lazily)
            # Host-side agreements (stop on a signal) go through gloo on CPU tensors: no GPU sync per step.
            self.control_group = dist.new_group(backend="gloo", timeout=timeout) if self.plan.backend == "nccl" else dist.group.WORLD
            if self.world_size > 1:
                store = dist.distributed_c10d._get_default_store()
                self.heartbeat = Heartbeat(store, self.rank, self.world_size, self.plan.timeout_s, self.run_dir)
                self.add_callback("on_val_batch_end", lambda _validator: self.heartbeat.working(self.heartbeat.step))
        except Exception as e:
            raise DistributedInitError(f"rank {self.rank}: the {self.plan.backend} process group did not start: {e}") from e

    def _setup_train(self):
        ckptio.remove_stale_temporaries(self.wdir)  # left by a writer that was SIGKILLed
        resume, self.resumed_from = ckptio.load_resumable(self.last, log=self._log)
        self.setup_model()
        state = resume[ckptio.RESUME_KEY] if resume else None
        if state is not None:
            self.model.load_state_dict(state["model"])  # the raw model in fp32: training continues exactly
        self.model = self.model.to(self.device)
        if self.device.type == "cuda" and self.args.channels_last is not False:
            self.model = self.model.to(memory_format=torch.channels_last)  # Ultralytics' CUDA default (fast convs)
        self.set_model_attributes()
        gs = max(int(self.model.stride.max() if hasattr(self.model, "stride") else 32), 32)
        self.args.imgsz = check_imgsz(self.args.imgsz, stride=gs, floor=gs, max_dim=1)
        self.stride = gs
        self.freeze_layer_names = [".dfl"]  # Ultralytics always freezes the DFL projection
        for name, p in self.model.named_parameters():
            if ".dfl" in name:
                p.requires_grad = False

        amp = self.cfg["train"]["amp"] if self.device.type == "cuda" else False
        self.amp = bool(amp)
        self.amp_dtype = torch.bfloat16 if amp == "bf16" else torch.float16
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp and self.amp_dtype == torch.float16)
        if self.use_ddp and self.cfg["dist"]["sync_bn"]:
            self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)

        # Everything that needs the bare network happens before it is wrapped: loaders and optimizer, class weights,
        # the EMA copy, the loss. `self.net` stays the bare network; `self.model` becomes what the step calls.
        self.net = self.model
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(device=self.device)
        self._build_train_pipeline()
        self.validator = self.get_validator()
        self.set_class_weights()
        self.ema = ModelEMA(self.net)
        # after the EMA copy: validation keeps Ultralytics' own, collective-free loss
        prepare_criterion(self.net, sync_free=bool(self.cfg["train"].get("sync_free_loss", True)))
        self.model = self._wrap(self.net)

        if self.rank == 0:
            keys = self.validator.metrics.keys + self.label_loss_items(prefix="val")
            self.metrics = dict(zip(keys, [0] * len(keys)))
        self.stopper, self.stop = EarlyStopping(patience=self.args.patience), False
        if state is not None:
            self._restore(state, resume)
        self.scheduler.last_epoch = self.start_epoch - 1
        self.run_callbacks("on_pretrain_routine_end")

    def _wrap(self, net: nn.Module) -> nn.Module:
        """What the training step calls: the network, CUDA-graphed if the plan says so, inside DDP or DataParallel."""
        model = self._graphed(net) if self.plan.cuda_graphs and self.device.type == "cuda" else net
        if self.use_ddp:
            model = nn.parallel.DistributedDataParallel(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=bool(self.cfg["dist"]["find_unused_parameters"]),
                gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: no copy in, no copy out
                **{BUFFER_SYNC_KWARG: bool(self.cfg["dist"]["broadcast_buffers"])},
            )
            # compiled around DDP, as torch recommends: Dynamo splits the graph at DDP's buckets, so each bucket's
            # all-reduce still overlaps the rest of the backward pass
            return compiled(model, self.cfg["train"].get("compile", False))
        if self.plan.mode == "dp":
            # One process drives every GPU of the node: images are scattered, predictions gathered on cuda:0.
            devices = list(range(self.plan.devices_per_rank)) if self.device.type == "cuda" else None
            return nn.DataParallel(model, device_ids=devices)
        return compiled(model, self.cfg["train"].get("compile", False))

    def _graphed(self, net: nn.Module) -> nn.Module:
        """The network with its training forward and backward captured as CUDA graphs (graphed.py); the plan resolved
        train.cuda_graphs and refused mode=dp. Captured before DDP wraps it, as torch requires, in train mode."""
        net.train()
        try:
            graphed = GraphedDetector(net, self.plan.batch_per_rank, self.args.imgsz, self.amp_dtype if self.amp else None)
        except Exception as e:  # a network with host syncs or data-dependent shapes in its forward cannot be captured
            failure = f"CUDA graph capture of the network failed ({type(e).__name__}: {e})"
            if self.cfg["train"].get("cuda_graphs", "auto") is True:
                raise RuntimeError(f"{failure}; train without graphs: train.cuda_graphs=false") from e
            self._log(f"WARNING: {failure}; training eagerly (train.cuda_graphs=auto)")
            return net
        self._log(f"CUDA graphs: forward and backward captured for batches of {self.plan.batch_per_rank}")
        return graphed

    def _restore(self, state: dict, ckpt: dict) -> None:
        """Continue where the checkpoint stopped: optimizer, scaler, EMA, position, best fitness, records."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.ema.ema.load_state_dict(state["ema"])
        self.ema.updates = state["ema_updates"]
        self.best_fitness, self.fitness = ckpt.get("best_fitness"), state.get("fitness")
        self.stopper.best_fitness = ckpt["stopper"]["best_fitness"]
        self.stopper.best_epoch = ckpt["stopper"]["best_epoch"]
        self.validated_epochs = list(state["validated_epochs"])
        self.fitness_epoch = state["fitness_epoch"]
        if self.rank == 0 and state.get("metrics"):
            self.metrics = dict(state["metrics"])
        epoch, batch = state["position"]
        if state["world_size"] != self.world_size and batch:
            self._log(f"world size changed ({state['world_size']} -> {self.world_size}): restarting epoch {epoch + 1}")
            batch = 0
        self.start_epoch, self.start_batch = epoch, batch
        if batch and state.get("tloss"):
            self.tloss = {k: torch.tensor(v, device=self.device) for k, v in state["tloss"].items()}
            self.tloss_steps = state["tloss_steps"]
            self.loss_items, self.loss_names = dict(self.tloss), tuple(self.tloss)  # the validator reads their keys
            self.loss = sum(self.tloss.values())  # read by Ultralytics' validate() even when no step runs first
        if self.rank == 0 and self._results_before:
            # rows of the epochs this checkpoint has completed; later ones (written before a failed save) go
            lines = self._results_before.splitlines()
            kept = [lines[0]] + [row for row in lines[1:] if int(float(row.split(",")[0])) <= epoch]
            self.csv.write_text("\n".join(kept) + "\n")
        self._log(f"resuming from {self.resumed_from} at epoch {epoch + 1}, step {batch + 1}")

    def _build_train_pipeline(self):
        plan = self.plan
        self.batch_size = plan.global_batch
        self.cores = self._bind_cores()
        self.train_loader = self._train_loader()
        self.args.workers = plan.workers_per_rank  # the validation loader uses twice this (Ultralytics' rule)
        self.test_loader = self.get_dataloader(
            self.data["val"], batch_size=plan.batch_per_rank * 2, rank=UL_LOCAL_RANK, mode="val"
        )
        self.test_loader.worker_init_fn = self._worker_init(_val_worker_init)
        self.accumulate = 1
        nb = self.batch_sampler.batches_per_epoch
        self.optimizer = self.build_optimizer(
            model=self.model,
            name=self.args.optimizer,
            lr=plan.lr0,
            momentum=self.args.momentum,
            decay=self.args.weight_decay,
            iterations=nb * self.epochs,
        )
        # fused on CUDA: GradScaler then skips an overflowing step on the device, without a host sync (fast_step.py)
        self.optimizer = fused_optimizer(self.optimizer, self.cfg["optim"].get("fused", "auto"), self.device)
        self._setup_scheduler()

    def _bind_cores(self) -> affinity.CoreSplit | None:
        """loader.bind_cores on a GPU node: this process on its own cores, its loader workers on the others."""
        if not self.cfg["loader"].get("bind_cores", True) or self.device.type != "cuda":
            return None
        split = affinity.split_cores(
            affinity.available_cores(), self.local_rank, self.plan.nproc_per_node, self.plan.workers_per_rank
        )
        if split is None:
            return None
        affinity.bind_process(split.main)
        main, workers = affinity.core_list(split.main), affinity.core_list(split.workers)
        self._log(f"cores: training process on {main}, loader workers on {workers}")
        return split

    def _worker_init(self, inner):
        return affinity.BindWorker(self.cores.workers, inner) if self.cores else inner

    def _setup_scheduler(self):
        self.lf = lrmod.lr_lambda(self.epochs, self.args.lrf, self.args.cos_lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda=self.lf)

    def preprocess_batch(self, batch: dict) -> dict:
        """Ultralytics' (to the device, images to [0, 1]), plus the batch's largest per-image target count, read
        while the labels are still on the CPU: the sync-free loss pads to it without asking the GPU."""
        max_targets = batch.get(MAX_TARGETS)
        if max_targets is None:
            max_targets = max_targets_per_image(batch["batch_idx"], len(batch["img"]))
        batch = super().preprocess_batch(batch)
        batch[MAX_TARGETS] = max_targets
        return batch

    # --- the node-wide image cache (train.cache=shared) ---------------------------------------------------------
    def _image_cache_dirs(self) -> list[Path]:
        return image_cache.default_dirs(Path(self.cfg["paths"]["cache"]).expanduser() / "images")

    def _prepare_image_caches(self) -> None:
        """Build (or map) the node's decoded-image caches before the process group exists: the first process on
        the node builds them with every core while the others wait at a file lock, not in a timed barrier."""
        if self.cfg["train"]["cache"] != "shared":
            return
        imgsz = check_imgsz(self.args.imgsz, stride=32, floor=32, max_dim=1)
        channels = self.data.get("channels", 3)
        self._image_caches = [  # held for the whole run: a cache in use is never evicted
            image_cache.ensure_cache(self.data[split], imgsz, channels=channels, dirs=self._image_cache_dirs(), log=self._log)
            for split in ("train", "val")
        ]

    def build_dataset(self, img_path, mode="train", batch=None):
        dataset = super().build_dataset(img_path, mode, batch)
        if self.cfg["train"]["cache"] == "shared":
            cache = image_cache.ensure_cache(
                img_path, dataset.imgsz, channels=dataset.channels, dirs=self._image_cache_dirs(), log=self._log
            )
            image_cache.attach_cache(dataset, cache)
        return dataset

    def _train_loader(self):
        loader_cfg = self.cfg["loader"]
        self.gpu_augment = None
        with torch_distributed_zero_first(UL_LOCAL_RANK):  # rank 0 writes the labels *.cache first
            if loader_cfg.get("gpu_augment"):
                dataset = self._raw_train_dataset()
            else:
                dataset = self.build_dataset(self.data["train"], mode="train", batch=self.plan.batch_per_rank)
        self.train_dataset = dataset
        if not loader_cfg.get("mosaic_buffer", True) and self.gpu_augment is None:
            set_mosaic_buffer(dataset, False)
        self.batch_sampler = EpochBatchSampler(
            len(dataset),
            self.plan.batch_per_rank,
            num_replicas=self.world_size if self.use_ddp else 1,
            rank=self.rank if self.use_ddp else 0,
            seed=int(self.cfg["seed"]),
        )
        workers = self.plan.workers_per_rank
        return torch.utils.data.DataLoader(
            dataset if self.gpu_augment is not None else EpochSeededDataset(dataset, int(self.cfg["seed"])),
            batch_sampler=self.batch_sampler,
            num_workers=workers,
            pin_memory=bool(loader_cfg["pin_memory"]) and self.device.type == "cuda",
            collate_fn=dataset.collate_fn,
            worker_init_fn=self._worker_init(worker_init),
            prefetch_factor=int(loader_cfg["prefetch_factor"]) if workers else None,
            persistent_workers=False,  # the iterator itself lives for the whole run (see _batches)
        )

    def _raw_train_dataset(self):
        """loader.gpu_augment: the CPU loads and resizes images (raw_loader.py); the device augments them."""
        from launcher.gpu_augment import GpuAugment
        from launcher.raw_loader import RawTrainDataset, build_raw_dataset

        if self.device.type != "cuda":
            self._log("loader.gpu_augment on the CPU: the same augmentation, computed by the training process")
        inner = build_raw_dataset(self.args, self.data["train"], self.plan.batch_per_rank, self.data)
        if self.cfg["train"]["cache"] == "shared":
            cache = image_cache.ensure_cache(
                self.data["train"], inner.imgsz, channels=inner.channels, dirs=self._image_cache_dirs(), log=self._log
            )
            image_cache.attach_cache(inner, cache)
        self.gpu_augment = GpuAugment(inner.imgsz, self.args)
        return RawTrainDataset(inner, int(self.cfg["seed"]), partners=self.cfg["loader"].get("mosaic_partners", "dataset"))

    def _augment_on_device(self, raw, ni: int) -> dict:
        """One batch's augmentation on the device, its randomness a function of (seed, step, rank) alone."""
        if not hasattr(self, "_aug_generator"):
            self._aug_generator = torch.Generator(device=self.device)
        self._aug_generator.manual_seed(sample_seed(int(self.cfg["seed"]), ni, self.rank))
        raw = raw.to(self.device, non_blocking=True)
        batch = self.gpu_augment(raw, self._aug_generator)
        # counted here, on the stream that augments (it syncs once for the boxes anyway), not in the training step
        batch[MAX_TARGETS] = max_targets_per_image(batch["batch_idx"], len(batch["im_file"]), read_device=True)
        return batch

    def _batches(self, epoch: int, start_batch: int = 0):
        """A fresh iterator over the training batches from (epoch, start_batch) onwards; old workers are stopped."""
        self._close_train_iterator()
        self.batch_sampler.start_at(epoch, start_batch)
        self._train_iter = iter(self.train_loader)
        return self._train_iter

    def _close_train_iterator(self) -> None:
        self._ahead = None  # a batch fetched ahead belongs to the iterator that is going
        old = getattr(self, "_train_iter", None)
        if old is not None and hasattr(old, "_shutdown_workers"):
            old._shutdown_workers()
        self._train_iter = None

    # --- the loop -------------------------------------------------------------------------------------------
    def _do_train(self):
        self._prepare_image_caches()
        if self.use_ddp:
            self._setup_ddp()
        self._setup_train()
        nb = self.batch_sampler.batches_per_epoch
        nw = self.plan.warmup_iterations if self.plan.warmup_iterations is not None else 0
        switch = max(self.epochs - self.args.close_mosaic, 0) if self.args.close_mosaic else None
        mosaic_closed = False
        meter = self._start_meter(skip_steps=10)
        persistent = bool(self.cfg["loader"]["persistent_workers"])
        self.train_time_start = time.time()
        self.epoch_time_start = time.time()
        self.run_callbacks("on_train_start")
        self._log(
            f"training {self.epochs - self.start_epoch} epoch(s) x {nb} step(s) per rank, batch {self.plan.batch_per_rank} "
            f"per rank, global {self.plan.global_batch}, lr0 {self.plan.lr0:.6g}, warmup {nw} step(s), "
            f"{self.plan.workers_per_rank} loader worker(s); {len(self.train_dataset)} train / "
            f"{len(self.test_loader.dataset)} val images; device {self.device}"
        )
        it = None
        self.epoch = self.start_epoch
        self.optimizer.zero_grad()
        for epoch in range(self.start_epoch, self.epochs):
            self.epoch = epoch
            first = self.start_batch if epoch == self.start_epoch else 0
            self.run_callbacks("on_train_epoch_start")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
                self.scheduler.step()
            self._model_train()
            if switch is not None and epoch >= switch and not mosaic_closed:
                mosaic_closed = True
                self._close_dataloader_mosaic()
                it = None  # prefetched batches still carry mosaic: restart the workers at this epoch
            if it is None or not persistent:
                it = self._batches(epoch, first)

            if epoch != self.start_epoch or not first:
                self.tloss, self.tloss_steps = None, 0  # a resumed epoch keeps the mean of its steps before the stop
            for i in range(first, nb):
                ni = i + nb * epoch
                batch = self._train_batch(it, ni, nw, epoch, ahead=i + 1 < nb)
                if self.record_samples:
                    self.samples_seen.setdefault(epoch, []).extend(Path(f).name for f in batch["im_file"])
                self.tloss_steps += 1
                n = self.tloss_steps
                self.tloss = (
                    self.loss_items
                    if self.tloss is None
                    else {k: (self.tloss[k] * (n - 1) + v) / n for k, v in self.loss_items.items()}
                )
                self.faults.at_step(ni + 1)
                self._beat("waiting", ni + 1)
                signum = self.stop_signal.agreed(self.control_group if self.use_ddp else None)
                self._beat("working", ni + 1)
                if signum:
                    self._stop_on_signal(signum, epoch, i + 1, nb)
                if self.log_every and (i + 1) % self.log_every == 0 and i + 1 < nb:
                    self._log_progress(epoch, i + 1, nb)
                self.run_callbacks("on_train_batch_end")

            meter.pause()
            if hasattr(self.net.criterion, "update"):
                self.net.criterion.update()
            self.lr = {f"lr/pg{ir}": x["lr"] for ir, x in enumerate(self.optimizer.param_groups)}
            self.run_callbacks("on_train_epoch_end")
            self.ema.update_attr(self.net, include=["yaml", "nc", "args", "names", "stride", "class_weights"])

            final_epoch = epoch + 1 >= self.epochs
            validated = final_epoch or (epoch + 1) % self.val_interval == 0 or self.stop  # same on every rank
            if validated:
                self._clear_memory(0.5)
                self.metrics, self.fitness = self.validate()
                self.validated_epochs.append(epoch + 1)
            if self.rank == 0:
                shown = self.metrics if validated else dict.fromkeys(self.metrics, float("nan"))  # not measured
                self.save_metrics(metrics={**self.label_loss_items(self.tloss), **shown, **self.lr})
                if validated:
                    self.stop |= self.stopper(epoch + 1, self.fitness)
                self.stop |= final_epoch
                self.save_model(validated=validated, position=(epoch + 1, 0))
                self.run_callbacks("on_model_save")
            self._log_progress(epoch, nb, nb, end_of_epoch=True, validated=validated)
            self._warn_if_input_bound()
            t = time.time()
            self.epoch_time, self.epoch_time_start = t - self.epoch_time_start, t
            self.run_callbacks("on_fit_epoch_end")
            self._clear_memory(0.5)
            self._beat("waiting", self.heartbeat.step if self.heartbeat else 0)
            self.stop = self._agree(self.stop)
            self._beat("working", self.heartbeat.step if self.heartbeat else 0)
            if self.stop:
                break

        self.epochs_completed = self.epoch + 1
        self._close_train_iterator()
        self._log(f"{self.epochs_completed - self.start_epoch} epoch(s) in {(time.time() - self.train_time_start) / 60:.2f} min")
        self.final_eval()
        if self.rank == 0:
            self.run_callbacks("on_train_end")
        self._clear_memory()

    def _start_meter(self, skip_steps: int) -> StepMeter:
        self.gpu_monitor = GpuMonitor(self._gpu_indices()) if self.device.type == "cuda" else None
        self.meter = StepMeter(
            self.device, skip_steps=skip_steps, monitor=self.gpu_monitor, in_flight=self.cfg["train"].get("steps_in_flight", 1)
        )
        self.loss_scale = lrmod.loss_scale(self.plan.base_batch, self.plan.batch_per_rank)
        self.grad_clip = float(self.cfg["optim"].get("grad_clip", 10.0))
        return self.meter

    def _train_batch(self, it, ni: int, nw: int, epoch: int, ahead: bool = False) -> dict:
        """Take one optimizer step on the next batch, metered; `ni` counts steps from the run's start. With `ahead`
        (another step of this epoch follows) the next batch is fetched while the GPU runs this step."""
        self.meter.wait_start()
        batch = self._take_ahead() if self._ahead is not None else self._fetch(it, ni)
        self.meter.batch_ready()
        self.run_callbacks("on_train_batch_start")
        if nw and ni <= nw:
            self._warmup(ni, nw, epoch)
        self._step_on(batch)
        if ahead and self.cfg["loader"].get("fetch_ahead", True):
            self._fetch_ahead(it, ni + 1)
        if not self.loss_names:
            self.loss_names = tuple(self.loss_items)
            if self.rank == 0:
                self.metrics.update(dict.fromkeys(self.label_loss_items(prefix="val"), 0.0))
        self.meter.step_end(len(batch["im_file"]))
        self._beat("working", ni + 1)
        return batch

    def _fetch(self, it, ni: int) -> dict:
        """Batch `ni` on the device, now: from the loader, augmented on the device if asked, preprocessed."""
        return self._finish(next(it), ni)

    def _fetch_ahead(self, it, ni: int) -> None:
        """Fetch batch `ni` now, while the GPU still runs the step just launched: its host-to-device copy (and its
        augmentation, with loader.gpu_augment) on a side stream, so that the copy engine and the step overlap and
        the next step starts on data already on the device. Only the loader's own delay counts as data wait."""
        start = time.perf_counter()
        raw = next(it)
        self.meter.add_wait(time.perf_counter() - start)
        if self._copy_stream is None:  # the CPU: nothing to overlap, the same batch either way
            self._ahead = (self._finish(raw, ni), None)
            return
        with torch.cuda.stream(self._copy_stream):
            batch = self._finish(raw, ni)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        self._ahead = (batch, ready)

    def _finish(self, raw, ni: int) -> dict:
        """A loader batch made ready for the step: augmented on the device (loader.gpu_augment), moved, scaled."""
        if self.gpu_augment is not None:
            raw = self._augment_on_device(raw, ni)
        return self.preprocess_batch(raw)

    def _take_ahead(self) -> dict:
        """The batch fetched ahead, for the compute stream: it waits for the copy on the device, not on the host, and
        the allocator keeps the batch's memory until the compute stream is done with it."""
        batch, ready = self._ahead
        self._ahead = None
        if ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(ready)
            for v in batch.values():
                if isinstance(v, torch.Tensor) and v.is_cuda:
                    v.record_stream(compute)
        return batch

    def _step_on(self, batch: dict) -> None:
        """One optimizer step on a batch already on the device, then the EMA."""
        self.loss, self.loss_items = train_step(
            self.model,
            batch,
            loss_scale=self.loss_scale,
            optimizer=self.optimizer,
            scaler=self.scaler,
            grad_clip=self.grad_clip,
            amp_dtype=self.amp_dtype if self.amp else None,
        )
        self.ema.update(self.net)

    def _beat(self, state: str, step: int) -> None:
        if self.heartbeat is not None:
            (self.heartbeat.working if state == "working" else self.heartbeat.waiting)(step)

    def _stop_on_signal(self, signum: int, epoch: int, next_batch: int, nb: int) -> None:
        """Every rank got here at the same step: save where we are, then leave with 128 + signal.

        After an epoch's last step the position is (epoch, nb): a resumed run has no step left in that epoch but
        still runs its end (validation, the results row, the epoch checkpoint)."""
        position = (epoch, next_batch)
        if self.rank == 0:
            self.save_model(validated=False, position=position)
            self._log(f"checkpoint saved at epoch {position[0] + 1} step {position[1] + 1}: {self.last}")
        self._close_train_iterator()
        if self.use_ddp and dist.is_initialized():
            dist.barrier()  # nobody leaves before rank 0's checkpoint is on disk
        raise SystemExit(128 + signum)

    def _gpu_indices(self) -> list[int]:
        if self.plan.mode == "dp":
            return list(range(self.plan.devices_per_rank))
        return [self.device.index or 0]

    def _close_dataloader_mosaic(self):
        self._log("closing mosaic for the last epochs")
        if self.gpu_augment is not None:
            self.train_dataset.close_mosaic()  # raw batches of one tile per sample: the device skips mosaic
        else:
            self.train_dataset.close_mosaic(hyp=deepcopy(self.args))

    def _warmup(self, ni: int, nw: int, epoch: int) -> None:
        """Ultralytics' warmup, over `nw` optimizer steps: bias lr falls from warmup_bias_lr, the others rise from 0."""
        xi = [0, nw]
        for g in self.optimizer.param_groups:
            start = self.args.warmup_bias_lr if g.get("param_group") == "bias" else 0.0
            g["lr"] = float(np.interp(ni, xi, [start, g["initial_lr"] * self.lf(epoch)]))
            if "momentum" in g:
                g["momentum"] = float(np.interp(ni, xi, [self.args.warmup_momentum, self.args.momentum]))

    def _agree(self, flag: bool) -> bool:
        """Rank 0's decision, on every rank (early stop is decided where the metrics are)."""
        if not (self.use_ddp and dist.is_initialized()):
            return flag
        box = [flag if self.rank == 0 else None]
        dist.broadcast_object_list(box, 0)
        return bool(box[0])

    # --- checkpoints ----------------------------------------------------------------------------------------
    def read_results_csv(self) -> dict:
        """results.csv as {column: values} (what Ultralytics stores in checkpoints), without its polars dependency."""
        import csv

        try:
            with open(self.csv, newline="") as f:
                rows = list(csv.DictReader(f))
        except OSError:
            return {}
        return {k: [float(r[k]) for r in rows] for k in (rows[0] if rows else {})}

    def _checkpoint_bytes(self, position: tuple[int, int]) -> bytes:
        """Ultralytics' checkpoint layout (YOLO() loads it; fp16 EMA), plus the exact state ddp-launch resumes from.

        Ultralytics resumes from the fp16 EMA as if it were the model, with fp16 optimizer moments: close, not
        exact. The resume state keeps the raw model, the EMA and the optimizer in full precision, and where in the
        epoch the run stopped.
        """
        ema = deepcopy(self.ema.ema).half().to(memory_format=torch.contiguous_format)
        if hasattr(ema, "criterion"):
            ema.criterion = None
        for v in ema.state_dict().values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                torch.nan_to_num_(v)

        def cpu_state(module) -> dict:
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

        buffer = io.BytesIO()
        torch.save(
            {
                "epoch": position[0] - 1 if position[1] == 0 else position[0],
                "best_fitness": self.best_fitness,
                "stopper": {"best_fitness": self.stopper.best_fitness, "best_epoch": self.stopper.best_epoch},
                "model": None,
                "ema": ema,
                "updates": self.ema.updates,
                "optimizer": convert_optimizer_state_dict_to_fp16(deepcopy(self.optimizer.state_dict())),
                "scaler": self.scaler.state_dict(),
                "train_args": vars(self.args),
                "train_metrics": {**(self.metrics or {}), "fitness": self.fitness},
                "train_results": self.read_results_csv(),
                "date": datetime.now().astimezone().isoformat(),
                "version": ULTRALYTICS_VERSION,
                "license": "AGPL-3.0 (https://ultralytics.com/license)",
                ckptio.RESUME_KEY: {
                    "position": position,  # (epoch, batch) the next step trains
                    "model": cpu_state(self.net),
                    "ema": cpu_state(self.ema.ema),
                    "ema_updates": self.ema.updates,
                    "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict(),
                    "fitness": self.fitness,
                    "fitness_epoch": self.fitness_epoch,
                    "validated_epochs": list(self.validated_epochs),
                    "metrics": dict(self.metrics or {}),
                    "tloss": {k: float(v) for k, v in (self.tloss or {}).items()},  # mean loss of the epoch so far
                    "tloss_steps": self.tloss_steps,
                    "world_size": self.world_size,
                    "global_batch": self.plan.global_batch,
                },
            },
            buffer,
        )
        return buffer.getvalue()

    def save_model(self, validated: bool = True, position: tuple[int, int] | None = None):
        if position is None:
            position = (self.epoch + 1, 0)
        if validated and self.fitness is not None and self.best_fitness == self.fitness:
            self.fitness_epoch = self.epoch + 1
        data = self._checkpoint_bytes(position)
        try:
            self.faults.at_checkpoint_write(self.last)
            ckptio.atomic_write_bytes(self.last, data, keep_previous=True)
            if validated and self.fitness_epoch == self.epoch + 1:
                ckptio.atomic_write_bytes(self.best, data)
            if self.save_period > 0 and self.epoch % self.save_period == 0 and position[1] == 0:
                ckptio.atomic_write_bytes(self.wdir / f"epoch{self.epoch}.pt", data)
        except OSError as e:
            raise ckptio.CheckpointError(
                f"could not write a checkpoint to {self.wdir} ({e.strerror or e}); the previous checkpoint "
                f"({self.last if self.last.exists() else 'none yet'}) is intact. Free space and resume with "
                f"ddp-launch resume={self.run_dir}"
            ) from e
        return True

    def final_eval(self):
        """Validate best.pt (when it is not the model just validated) on every rank; strip the training state.

        Rank 0 decides and loads best.pt, then hands its weights to the other ranks: they may run on nodes that do
        not share the run folder.
        """
        revalidate = self._agree(
            self.rank == 0 and self.best.exists() and self.fitness_epoch not in (None, self.epochs_completed)
        )
        if revalidate:
            if self.rank == 0:
                ckpt = ckptio.load(self.best)
                self.ema.ema.load_state_dict(ckpt["ema"].float().state_dict())
                self._log(f"validating best.pt (epoch {self.fitness_epoch})")
            if self.use_ddp and dist.is_initialized():
                for t in self.ema.ema.state_dict().values():
                    dist.broadcast(t, 0)
            self.metrics, _ = self.validate()
        if self.rank == 0:
            for f in (self.last, self.best, ckptio.previous_of(self.last)):
                if f.exists():
                    strip_optimizer(f, updates={ckptio.RESUME_KEY: None})
            ckptio.previous_of(self.last).unlink(missing_ok=True)

    # --- logging ----------------------------------------------------------------------------------------------
    def _log(self, msg: str) -> None:
        print(f"[rank {self.rank}] {msg}", flush=True)

    def _log_progress(self, epoch: int, step: int, nb: int, end_of_epoch: bool = False, validated: bool = False):
        ips, wait = self.meter.recent()
        losses = " ".join(f"{k.replace('_loss', '')} {float(v):.4g}" for k, v in (self.tloss or {}).items())
        lr = self.optimizer.param_groups[0]["lr"]
        mem = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0
        speed = f"{ips:.1f} img/s, data wait {100 * wait:.0f}%" if ips else "warming up"
        line = f"epoch {epoch + 1}/{self.epochs} step {step}/{nb} | loss {losses} | {speed} | lr {lr:.5g}"
        if mem:
            line += f" | mem {mem:.2f}G"
        if self.gpu_monitor is not None and self.gpu_monitor.available and end_of_epoch:
            line += " | GPU busy " + ", ".join(f"{g.util_mean:.0f}%" for g in self.gpu_monitor.stats())
        if any(not np.isfinite(float(v)) for v in (self.tloss or {}).values()):
            line += " | WARNING: the loss is not finite"
        if end_of_epoch and validated and self.rank == 0 and self.metrics:
            line += f" | mAP50 {self.metrics.get('metrics/mAP50(B)', 0):.4f} mAP50-95 {self.metrics.get('metrics/mAP50-95(B)', 0):.4f}"
        self._log(line)

    def _warn_if_input_bound(self) -> None:
        """One line, once per run, when this rank waits for data more than 10 % of its step time."""
        m = self.meter.summary()
        if getattr(self, "_warned_input", False) or m.steps_measured < 10 or m.data_wait <= INPUT_BOUND:
            return
        self._warned_input = True
        busy = ""
        if self.gpu_monitor is not None and self.gpu_monitor.available:
            busy = f" (GPU {min(g.util_mean for g in self.gpu_monitor.stats()):.0f} % busy)"
        self._log(
            f"WARNING input-bound: {100 * m.data_wait:.0f} % of step time waiting for data{busy}; raise loader.workers "
            f"(now {self.plan.workers_per_rank}) or set train.cache=ram"
        )

    # --- the record of the run ------------------------------------------------------------------------------
    def rank_report(self) -> dict:
        m = self.meter.summary()
        gpus = [vars(g) for g in self.gpu_monitor.stats()] if self.gpu_monitor is not None else []
        # Learnable parameters only: BatchNorm running statistics are each rank's own after its last forward
        # (DDP broadcasts rank 0's before every forward), and only rank 0's are saved.
        h = hashlib.sha256()
        for k, p in sorted(self.net.named_parameters()):
            h.update(k.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        return {
            "rank": self.rank,
            "device": str(self.device),
            "images_per_s": m.images_per_s,
            "data_wait": m.data_wait,
            "steps_measured": m.steps_measured,
            "step_ms": m.step_ms,
            "gpus": gpus,
            "gpu_util": sum(g["util_mean"] for g in gpus) / len(gpus) if gpus else None,
            "memory_peak_gib": max((g["memory_peak_gib"] for g in gpus), default=None),
            "params_sha256": h.hexdigest(),
            "loss": {k: float(v) for k, v in (self.loss_items or {}).items()},  # the last step's: a sanity check
            "validated_epochs": self.validated_epochs,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "samples": {str(e): names for e, names in self.samples_seen.items()} if self.record_samples else None,
        }


def _host_cpu_busy(start, end) -> float:
    """Share of all host cores busy between two psutil.cpu_times() readings."""
    total = sum(end) - sum(start)
    idle = (end.idle - start.idle) + (getattr(end, "iowait", 0) - getattr(start, "iowait", 0))
    return 1 - idle / total if total > 0 else 0.0


class BenchTrainer(LaunchTrainer):
    """One cell of ddp-bench: the training step of a real run, metered, then the same step without the loader."""

    def _do_train(self):
        import psutil

        bench = self.cfg["bench"]
        warmup, steps = int(bench["warmup_steps"]), int(bench["steps"])
        self._prepare_image_caches()
        if self.use_ddp:
            self._setup_ddp()
        self._setup_train()
        self._start_meter(skip_steps=warmup)
        nb = self.batch_sampler.batches_per_epoch
        it = self._batches(0)
        self._model_train()
        cpu_start = None
        for n in range(warmup + steps):
            if n == warmup:
                cpu_start = psutil.cpu_times()
            self.epoch = n // nb  # the sampler runs on across epochs; the loop does not stop for them
            self._train_batch(it, n, 0, self.epoch, ahead=n + 1 < warmup + steps)
            if self.rank == 0 and (n + 1) % max(1, (warmup + steps) // 5) == 0:
                self._log(f"bench step {n + 1}/{warmup + steps}")
        self.meter.pause()
        self.host_cpu = _host_cpu_busy(cpu_start, psutil.cpu_times()) if cpu_start is not None else 0.0
        self.ceiling = self._ceiling(it, int(bench["ceiling_batches"]), max(steps // 2, 10))  # stops the loader
        self.epochs_completed = 0

    def _ceiling(self, it, n_batches: int, steps: int) -> float:
        """images/s of the same trainer step on `n_batches` real batches already on the device, cycled."""
        batches = [self._fetch(it, j) for j in range(n_batches)]
        # The loader's workers stop first: still prefetching, they would compete with this process for the cores
        # and the ceiling would measure the host's contention, not the step.
        self._close_train_iterator()
        images = 0
        for j in range(steps + 3):
            if j == 3:  # a few unmeasured steps after switching from the loader
                self._sync()
                t0 = time.perf_counter()
            self._step_on(batches[j % n_batches])
            images += len(batches[j % n_batches]["im_file"]) if j >= 3 else 0
        self._sync()
        ips = images / (time.perf_counter() - t0)
        if self.cfg["bench"].get("profile") and self.rank == 0:
            self._profile(batches)
        return ips

    def _profile(self, batches: list[dict], steps: int = 10) -> None:
        """torch.profiler over a few data-free steps: where the step's time goes (bench.profile=true)."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for j in range(steps):
                self._step_on(batches[j % len(batches)])
            self._sync()
        table = prof.key_averages().table
        text = [f"{steps} data-free steps, batch {self.plan.batch_per_rank}, {self.device}"]
        if self.device.type == "cuda":
            text.append(table(sort_by="self_device_time_total", row_limit=40))  # where the GPU time goes
        text.append(table(sort_by="self_cpu_time_total", row_limit=25))  # where the host time goes
        (self.run_dir / "profile.txt").write_text("\n\n".join(text))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def rank_report(self) -> dict:
        report = super().rank_report()
        report.update(ceiling_images_per_s=self.ceiling, host_cpu=self.host_cpu)
        return report


def benchmark(cfg: dict, plan: LaunchPlan, run_dir: Path) -> dict | None:
    """Run one bench cell on this rank; rank 0 writes cell.json with every rank's figures."""

    def cell(trainer: LaunchTrainer, reports: list[dict]) -> dict:
        return {"mode": plan.mode, "size": plan.world_size * plan.devices_per_rank, "ranks": reports}

    return _run_rank(BenchTrainer(cfg, plan, run_dir), "cell.json", cell)


def _run_rank(trainer: LaunchTrainer, record: str, build) -> dict | None:
    """Train, gather every rank's report, and have rank 0 write `build(trainer, reports)` as RUN_DIR/record."""
    try:
        trainer.train()
        reports = _gather_reports(trainer)
        if trainer.rank != 0:
            return None
        result = build(trainer, reports)
        ckptio.atomic_write_bytes(trainer.run_dir / record, json.dumps(result, indent=2).encode())
        return result
    finally:
        _teardown(trainer)


def _gather_reports(trainer: LaunchTrainer) -> list[dict]:
    report = trainer.rank_report()
    reports = [report]
    if trainer.use_ddp and dist.is_initialized() and trainer.world_size > 1:
        reports = [None] * trainer.world_size
        dist.all_gather_object(reports, report)
    (trainer.run_dir / "ranks").mkdir(exist_ok=True)
    (trainer.run_dir / "ranks" / f"rank{trainer.rank}.json").write_text(json.dumps(report, indent=2))
    return reports


def _teardown(trainer: LaunchTrainer) -> None:
    if getattr(trainer, "gpu_monitor", None) is not None:
        trainer.gpu_monitor.close()
    if trainer.heartbeat is not None:
        trainer.heartbeat.close()
    trainer.stop_signal.restore()
    if dist.is_initialized():
        dist.destroy_process_group()


def _val_worker_init(worker_id: int) -> None:
    """Ultralytics' seeding for the validation loader's workers, plus surviving the rank's SIGTERM."""
    from ultralytics.data.build import seed_worker

    from launcher.shutdown import ignore_termination_in_worker

    ignore_termination_in_worker()
    seed_worker(worker_id)


def train(cfg: dict, plan: LaunchPlan, run_dir: Path) -> dict | None:
    """Train on this rank; rank 0 writes summary.json. Returns the summary on rank 0."""
    return _run_rank(LaunchTrainer(cfg, plan, run_dir), "summary.json", build_summary)


def build_summary(trainer: LaunchTrainer, reports: list[dict]) -> dict:
    plan, metrics = trainer.plan, trainer.metrics or {}
    weights = trainer.best if trainer.best.exists() else trainer.last
    digests = {r["params_sha256"] for r in reports}
    utils = [r["gpu_util"] for r in reports if r.get("gpu_util") is not None]
    return {
        "status": "finished",
        "map50": float(metrics.get("metrics/mAP50(B)", 0.0)),
        "map50_95": float(metrics.get("metrics/mAP50-95(B)", 0.0)),
        "precision": float(metrics.get("metrics/precision(B)", 0.0)),
        "recall": float(metrics.get("metrics/recall(B)", 0.0)),
        "epochs_completed": trainer.epochs_completed,
        "epochs": trainer.epochs,
        "validated_epochs": trainer.validated_epochs,
        "best_epoch": trainer.fitness_epoch,
        "world_size": plan.world_size,
        "mode": plan.mode,
        "backend": plan.backend,
        "device": plan.device,
        "global_batch": plan.global_batch,
        "batch_per_device": plan.batch_per_device,
        "lr0": plan.lr0,
        "warmup_iterations": plan.warmup_iterations,
        "images_per_s": sum(r["images_per_s"] for r in reports),  # ranks run concurrently: their rates add up
        "data_wait": max(r["data_wait"] for r in reports),  # the worst-fed rank sets the pace
        "gpu_util": min(utils) if utils else None,  # the least busy GPU
        "weights": str(weights),
        "last": str(trainer.last),
        "run_dir": str(trainer.run_dir),
        "resumed": any(r.get("resumed_from") for r in reports),
        "loss_finite": all(math.isfinite(v) for r in reports for v in r["loss"].values()),
        "ranks_params_identical": len(digests) == 1,
        "ranks": [{k: v for k, v in r.items() if k != "samples"} for r in reports],
        "train_minutes": (time.time() - trainer.train_time_start) / 60,
    }
