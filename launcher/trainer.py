"""The one module that drives Ultralytics' trainer: a DetectionTrainer running in-process inside a torchrun rank.

Ultralytics keeps the model, the loss, the datasets, the validator, EMA, the optimizer's parameter groups and the
checkpoint format (weights stay loadable with `YOLO("best.pt")`). ddp-launch replaces the parts that are wrong
or opaque under an external torchrun (../shared/notes/ultralytics-8.4.md):

* world size, rank and device from torchrun's environment, not from the device string (multi-node, CPU);
* the process group is ours: backend from the plan, timeout `dist.timeout_s` (not 3 hours);
* DDP without find_unused_parameters, device_ids only on CUDA, BatchNorm buffers kept in sync;
* the training loader: a DistributedSampler whose epoch is set when the loader reaches that epoch (sampler.py);
* the update: loss scaled so lr0 means one thing (lr.py), no hidden accumulation or weight-decay rescaling;
* validation every `val_interval` epochs, decided the same way on every rank;
* no AMP check (it downloads weights); a steady-state throughput meter; atomic checkpoints; summary.json.
"""

from __future__ import annotations

import hashlib
import io
import json
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

from launcher import checkpoint as ckptio
from launcher import lr as lrmod
from launcher.loss_sync import use_global_normaliser
from launcher.meter import StepMeter
from launcher.plan import LaunchPlan
from launcher.sampler import EpochBatchSampler, EpochSeededDataset, worker_init

from ultralytics import __version__ as ULTRALYTICS_VERSION  # noqa: E402  (env is set: imported by the worker)
from ultralytics.models.yolo.detect import DetectionTrainer
from ultralytics.utils import LOCAL_RANK as UL_LOCAL_RANK
from ultralytics.utils import LOGGER
from ultralytics.utils.checks import check_imgsz
from ultralytics.utils.torch_utils import (
    TORCH_2_13,
    EarlyStopping,
    ModelEMA,
    autocast,
    convert_optimizer_state_dict_to_fp16,
    strip_optimizer,
    torch_distributed_zero_first,
    unwrap_model,
)

OPTIMIZER_NAMES = {"sgd": "SGD", "adamw": "AdamW"}
# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (the old name warns); the GPU machines run 2.11.
BUFFER_SYNC_KWARG = "forward_sync_buffers" if TORCH_2_13 else "broadcast_buffers"


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
        "cache": train["cache"],
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
    """One optimizer step: forward with the loss, backward, unscale, clip, step. Returns (loss, loss items).

    `loss_scale` turns the rank's summed loss into base_batch x its mean (lr.loss_scale), so DDP's gradient average
    is the same update a single process would take on the whole global batch.
    """
    device_type = next(model.parameters()).device.type
    with autocast(amp_dtype if amp_dtype is not None else False, device=device_type):
        loss, items = model(batch)
        loss = loss.sum() * loss_scale
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.detach(), items


def prepare_criterion(model) -> None:
    """Build the model's loss now (Ultralytics builds it lazily) and normalise it over the global batch."""
    m = unwrap_model(model)
    m.criterion = m.init_criterion()
    if not use_global_normaliser(m.criterion):
        LOGGER.warning(f"{type(m.criterion).__name__}: loss normalised per rank (not a YOLO detection loss)")


class LaunchTrainer(DetectionTrainer):
    """Ultralytics' DetectionTrainer with ddp-launch's distributed setup, loader, update rule and loop."""

    def __init__(self, cfg: dict, plan: LaunchPlan, run_dir: Path):
        self.cfg, self.plan, self.run_dir = cfg, plan, Path(run_dir)
        self.rank, self.local_rank, world = rank_info()
        super().__init__(overrides=ultralytics_args(cfg, plan, run_dir))
        self.world_size = world  # Ultralytics derives it from the device string: 1 per rank, 0 on the CPU
        self.use_ddp = plan.mode == "ddp"
        torch.set_num_threads(plan.threads_per_rank)  # Ultralytics' select_device reset it
        self.val_interval = int(cfg["train"]["val_interval"])
        self.log_every = int(cfg.get("log", {}).get("interval_steps", 20))
        self.record_samples = bool(cfg.get("debug", {}).get("record_samples"))
        self.validated_epochs: list[int] = []
        self.samples_seen: dict[int, list[str]] = {}
        self.fitness_epoch: int | None = None  # the epoch best.pt holds

    # --- setup ----------------------------------------------------------------------------------------------
    def _setup_ddp(self):
        """Our process group: env:// rendezvous from torchrun, the plan's backend, a bounded timeout."""
        if self.plan.device == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        dist.init_process_group(backend=self.plan.backend, timeout=timedelta(seconds=self.plan.timeout_s))

    def _setup_train(self):
        ckpt = self.setup_model()
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

        if self.use_ddp:
            if self.cfg["dist"]["sync_bn"]:
                self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
            self.model = nn.parallel.DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=bool(self.cfg["dist"]["find_unused_parameters"]),
                **{BUFFER_SYNC_KWARG: bool(self.cfg["dist"]["broadcast_buffers"])},
            )

        self._build_train_pipeline()
        self.validator = self.get_validator()
        self.set_class_weights()
        self.ema = ModelEMA(self.model)
        prepare_criterion(self.model)  # after the EMA copy: validation keeps Ultralytics' own, collective-free loss
        if self.rank == 0:
            keys = self.validator.metrics.keys + self.label_loss_items(prefix="val")
            self.metrics = dict(zip(keys, [0] * len(keys)))
        self.stopper, self.stop = EarlyStopping(patience=self.args.patience), False
        self.resume_training(ckpt)
        self.scheduler.last_epoch = self.start_epoch - 1
        self.run_callbacks("on_pretrain_routine_end")

    def _build_train_pipeline(self):
        plan = self.plan
        self.batch_size = plan.global_batch
        self.train_loader = self._train_loader()
        self.args.workers = plan.workers_per_rank  # the validation loader uses twice this (Ultralytics' rule)
        self.test_loader = self.get_dataloader(
            self.data["val"], batch_size=plan.batch_per_rank * 2, rank=UL_LOCAL_RANK, mode="val"
        )
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
        self._setup_scheduler()

    def _setup_scheduler(self):
        self.lf = lrmod.lr_lambda(self.epochs, self.args.lrf, self.args.cos_lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda=self.lf)

    def _train_loader(self):
        loader_cfg = self.cfg["loader"]
        with torch_distributed_zero_first(UL_LOCAL_RANK):  # rank 0 writes the labels *.cache first
            dataset = self.build_dataset(self.data["train"], mode="train", batch=self.plan.batch_per_rank)
        self.train_dataset = dataset
        self.batch_sampler = EpochBatchSampler(
            len(dataset),
            self.plan.batch_per_rank,
            num_replicas=self.world_size if self.use_ddp else 1,
            rank=self.rank if self.use_ddp else 0,
            seed=int(self.cfg["seed"]),
        )
        workers = self.plan.workers_per_rank
        return torch.utils.data.DataLoader(
            EpochSeededDataset(dataset, int(self.cfg["seed"])),
            batch_sampler=self.batch_sampler,
            num_workers=workers,
            pin_memory=bool(loader_cfg["pin_memory"]) and self.device.type == "cuda",
            collate_fn=dataset.collate_fn,
            worker_init_fn=worker_init,
            prefetch_factor=int(loader_cfg["prefetch_factor"]) if workers else None,
            persistent_workers=False,  # the iterator itself lives for the whole run (see _batches)
        )

    def _batches(self, epoch: int, start_batch: int = 0):
        """A fresh iterator over the training batches from (epoch, start_batch) onwards; old workers are stopped."""
        old = getattr(self, "_train_iter", None)
        if old is not None and hasattr(old, "_shutdown_workers"):
            old._shutdown_workers()
        self.batch_sampler.start_at(epoch, start_batch)
        self._train_iter = iter(self.train_loader)
        return self._train_iter

    # --- the loop -------------------------------------------------------------------------------------------
    def _do_train(self):
        if self.use_ddp:
            self._setup_ddp()
        self._setup_train()
        nb = self.batch_sampler.batches_per_epoch
        nw = self.plan.warmup_iterations if self.plan.warmup_iterations is not None else 0
        switch = max(self.epochs - self.args.close_mosaic, 0) if self.args.close_mosaic else None
        mosaic_closed = False
        meter = StepMeter(self.device)
        self.meter = meter
        scale = lrmod.loss_scale(self.plan.base_batch, self.plan.batch_per_rank)
        persistent = bool(self.cfg["loader"]["persistent_workers"])
        grad_clip = float(self.cfg["optim"].get("grad_clip", 10.0))
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
        self.optimizer.zero_grad()
        for epoch in range(self.start_epoch, self.epochs):
            self.epoch = epoch
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
                it = self._batches(epoch)

            self.tloss = None
            for i in range(nb):
                meter.wait_start()
                batch = next(it)
                batch = self.preprocess_batch(batch)
                meter.batch_ready()
                if self.record_samples:
                    self.samples_seen.setdefault(epoch, []).extend(Path(f).name for f in batch["im_file"])
                self.run_callbacks("on_train_batch_start")
                ni = i + nb * epoch
                if nw and ni <= nw:
                    self._warmup(ni, nw, epoch)

                self.loss, self.loss_items = train_step(
                    self.model,
                    batch,
                    loss_scale=scale,
                    optimizer=self.optimizer,
                    scaler=self.scaler,
                    grad_clip=grad_clip,
                    amp_dtype=self.amp_dtype if self.amp else None,
                )
                self.ema.update(self.model)
                if not self.loss_names:
                    self.loss_names = tuple(self.loss_items)
                    if self.rank == 0:
                        self.metrics.update(dict.fromkeys(self.label_loss_items(prefix="val"), 0.0))
                self.tloss = (
                    self.loss_items
                    if self.tloss is None
                    else {k: (self.tloss[k] * i + v) / (i + 1) for k, v in self.loss_items.items()}
                )
                meter.step_end(len(batch["im_file"]))
                if self.log_every and (i + 1) % self.log_every == 0 and i + 1 < nb:
                    self._log_progress(epoch, i + 1, nb)
                self.run_callbacks("on_train_batch_end")

            meter.pause()
            if hasattr(unwrap_model(self.model).criterion, "update"):
                unwrap_model(self.model).criterion.update()
            self.lr = {f"lr/pg{ir}": x["lr"] for ir, x in enumerate(self.optimizer.param_groups)}
            self.run_callbacks("on_train_epoch_end")
            self.ema.update_attr(self.model, include=["yaml", "nc", "args", "names", "stride", "class_weights"])

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
                self.save_model(validated=validated)
                self.run_callbacks("on_model_save")
            self._log_progress(epoch, nb, nb, end_of_epoch=True, validated=validated)
            t = time.time()
            self.epoch_time, self.epoch_time_start = t - self.epoch_time_start, t
            self.run_callbacks("on_fit_epoch_end")
            self._clear_memory(0.5)
            self.stop = self._agree(self.stop)
            if self.stop:
                break

        self.epochs_completed = self.epoch + 1
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self._log(f"{self.epochs_completed - self.start_epoch} epoch(s) in {(time.time() - self.train_time_start) / 60:.2f} min")
        self.final_eval()
        if self.rank == 0:
            self.run_callbacks("on_train_end")
        self._clear_memory()

    def _close_dataloader_mosaic(self):
        self._log("closing mosaic for the last epochs")
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
    def _checkpoint_bytes(self) -> bytes:
        """Ultralytics' checkpoint layout (YOLO() loads it), plus what ddp-launch needs to resume exactly."""
        ema = deepcopy(self.ema.ema).half().to(memory_format=torch.contiguous_format)
        if hasattr(ema, "criterion"):
            ema.criterion = None
        for v in ema.state_dict().values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                torch.nan_to_num_(v)
        buffer = io.BytesIO()
        torch.save(
            {
                "epoch": self.epoch,
                "best_fitness": self.best_fitness,
                "stopper": {"best_fitness": self.stopper.best_fitness, "best_epoch": self.stopper.best_epoch},
                "model": None,
                "ema": ema,
                "updates": self.ema.updates,
                "optimizer": convert_optimizer_state_dict_to_fp16(deepcopy(self.optimizer.state_dict())),
                "scaler": self.scaler.state_dict(),
                "train_args": vars(self.args),
                "train_metrics": {**self.metrics, "fitness": self.fitness},
                "train_results": self.read_results_csv(),
                "date": datetime.now().astimezone().isoformat(),
                "version": ULTRALYTICS_VERSION,
                "license": "AGPL-3.0 (https://ultralytics.com/license)",
                "ddp_launch": {
                    "epoch": self.epoch,
                    "validated_epochs": list(self.validated_epochs),
                    "fitness_epoch": self.fitness_epoch,
                    "world_size": self.world_size,
                    "global_batch": self.plan.global_batch,
                },
            },
            buffer,
        )
        return buffer.getvalue()

    def read_results_csv(self) -> dict:
        """results.csv as {column: values} (what Ultralytics stores in checkpoints), without its polars dependency."""
        import csv

        try:
            with open(self.csv, newline="") as f:
                rows = list(csv.DictReader(f))
        except OSError:
            return {}
        return {k: [float(r[k]) for r in rows] for k in (rows[0] if rows else {})}

    def save_model(self, validated: bool = True):
        data = self._checkpoint_bytes()
        ckptio.atomic_write_bytes(self.last, data)
        if validated and self.fitness is not None and self.best_fitness == self.fitness:
            self.fitness_epoch = self.epoch + 1
            ckptio.atomic_write_bytes(self.best, data)
        if self.save_period > 0 and self.epoch % self.save_period == 0:
            ckptio.atomic_write_bytes(self.wdir / f"epoch{self.epoch}.pt", data)
        return True

    def final_eval(self):
        """Validate best.pt (when it is not the model just validated) on every rank; strip optimizer state.

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
            for f in (self.last, self.best):
                if f.exists():
                    strip_optimizer(f)

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
        if end_of_epoch and validated and self.rank == 0 and self.metrics:
            line += f" | mAP50 {self.metrics.get('metrics/mAP50(B)', 0):.4f} mAP50-95 {self.metrics.get('metrics/mAP50-95(B)', 0):.4f}"
        self._log(line)

    # --- the record of the run ------------------------------------------------------------------------------
    def rank_report(self) -> dict:
        m = self.meter.summary()
        # Learnable parameters only: BatchNorm running statistics are each rank's own after its last forward
        # (DDP broadcasts rank 0's before every forward), and only rank 0's are saved.
        h = hashlib.sha256()
        for k, p in sorted(unwrap_model(self.model).named_parameters()):
            h.update(k.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        return {
            "rank": self.rank,
            "device": str(self.device),
            "images_per_s": m.images_per_s,
            "data_wait": m.data_wait,
            "steps_measured": m.steps_measured,
            "step_ms": m.step_ms,
            "params_sha256": h.hexdigest(),
            "validated_epochs": self.validated_epochs,
            "samples": {str(e): names for e, names in self.samples_seen.items()} if self.record_samples else None,
        }


def train(cfg: dict, plan: LaunchPlan, run_dir: Path) -> dict | None:
    """Train on this rank; rank 0 writes summary.json. Returns the summary on rank 0."""
    trainer = LaunchTrainer(cfg, plan, run_dir)
    try:
        trainer.train()
        report = trainer.rank_report()
        reports = [report]
        if trainer.use_ddp and dist.is_initialized() and trainer.world_size > 1:
            reports = [None] * trainer.world_size
            dist.all_gather_object(reports, report)
        (Path(run_dir) / "ranks").mkdir(exist_ok=True)
        (Path(run_dir) / "ranks" / f"rank{trainer.rank}.json").write_text(json.dumps(report, indent=2))
        if trainer.rank != 0:
            return None
        summary = build_summary(trainer, reports)
        (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_summary(trainer: LaunchTrainer, reports: list[dict]) -> dict:
    plan, metrics = trainer.plan, trainer.metrics or {}
    weights = trainer.best if trainer.best.exists() else trainer.last
    digests = {r["params_sha256"] for r in reports}
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
        "weights": str(weights),
        "last": str(trainer.last),
        "run_dir": str(trainer.run_dir),
        "ranks_params_identical": len(digests) == 1,
        "ranks": [{k: v for k, v in r.items() if k != "samples"} for r in reports],
        "train_minutes": (time.time() - trainer.train_time_start) / 60,
    }
