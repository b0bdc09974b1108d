"""What a rank builds before its first step, in the order it must be built (each line says why it stands there):

0. nvJPEG's warm-up, and the compilation of the training graphs' Triton kernels (kernels.py), then of the GPU input's
   (once 4 has built it), each on a thread beside everything up to 5 (prewarm.py), joined before any graph is
   captured;
1. the node-shared image cache, before the process group (its build may outlast dist.timeout_s: nobody waits for it
   in a timed barrier);
   with train.batch_per_device=auto, this GPU's largest batch, measured before the process group too (the loss's
   normaliser would all-reduce, and ranks measure different sizes) on a network, optimizer, EMA and CUDA graphs of
   its own, freed before the run's own are built: everything below is built for the batch chosen (batch_probe.py);
2. the process group, and the heartbeat over its store; the job's batch, the smallest any rank measured;
3. the network, from model.cfg and/or model.weights, with the resume state loaded before anything copies it;
4. the training loader (training_input.py), the validation loader and validator (validation_build.py: the validator
   copies the hyperparameters once max_det is set; the fast one reads the loader once, at the first validation),
   the optimizer on the bare network;
5. class weights, then the EMA copy (it carries them), then the training loss (the EMA keeps Ultralytics' own, which
   validation uses, collective-free);
6. what the step calls (step_build.py): on one GPU the whole step's forward, loss and backward captured
   (step/captured_step.py); elsewhere CUDA graphs captured on the bare network, then DDP or DataParallel around it;
7. the checkpoint's components, whose saved states (optimizer, scaler, EMA, position) restore() loads.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from launcher.machine.environment_report import report as environment_report
from launcher.plan.plan import LaunchPlan
from launcher.rank.build_steps import batch_probe, step_build, training_input, validation_build
from launcher.rank.kernels import kernels
from launcher.rank.loop import checkpoint_io
from launcher.rank.data.pipeline import TrainInputs, to_device
from launcher.rank.data.sampler import EpochBatchSampler, mosaic_closes_at, sample_seed
from launcher.rank.group.dist import Comm, rank_info
from launcher.rank.group.faults import FaultInjector
from launcher.rank.group.heartbeat import Heartbeat, NoHeartbeat
from launcher.rank.group.lines import rank_lines
from launcher.rank.startup.prewarm import Prewarm
from launcher.rank.loop.state import Checkpointer, TrainState, upgrade
from launcher.rank.step import auto_batch
from launcher.rank.step.optimizer import Schedule, fused_optimizer
from launcher.rank.ultralytics import build
from launcher.rank.ultralytics.loss import training_criterion
from launcher.run_folder import RunFolder


class EmaState:
    """Ultralytics' ModelEMA as a checkpoint component: its weights in full precision and its update count."""

    def __init__(self, ema):
        self.ema = ema

    def state_dict(self) -> dict:
        return {"weights": self.ema.ema.state_dict(), "updates": self.ema.updates}  # the checkpointer copies

    def load_state_dict(self, state: dict) -> None:
        self.ema.ema.load_state_dict(state["weights"])
        self.ema.updates = state["updates"]


class Rank:
    """Everything one rank trains with. `Rank(cfg, plan, folder, validation=False)` leaves out the validation set
    (a ddp-bench cell)."""

    def __init__(self, cfg: dict, plan: LaunchPlan, folder: RunFolder, *, validation: bool = True):
        self.cfg, self.plan, self.folder = cfg, plan, folder
        self.rank, self.local_rank, world = rank_info()
        self.log, self.detail = rank_lines(self.rank)  # a line for the console; a diagnostic
        self.world = world
        self.device = torch.device("cuda", self.local_rank) if plan.device == "cuda" else torch.device("cpu")
        self.setup_stamps: list[tuple[str, float]] = []  # where the start-up went (summary.json's timeline)
        self.setup_memory: dict[str, float] = {}
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.empty(1, device=self.device)  # the driver and the CUDA context, made here to be timed as their own part
        self._stamp("cuda_init")
        train, loader_cfg = cfg["train"], cfg["loader"]
        amp = train["amp"] if self.device.type == "cuda" else False
        self.amp_dtype = (torch.bfloat16 if amp == "bf16" else torch.float16) if amp else None
        # the training graphs' Triton kernels (step/triton_modules.py), compiled on a thread from the start: on a fresh
        # machine (no Triton cache) compiling them takes longer than the set-up's other parts
        self.kernels = (kernels.WarmUp(self.device, self.amp_dtype or torch.float32, kernels.TRAINING)
                        if self.device.type == "cuda" and plan.cuda_graphs else None)
        self.input_kernels: kernels.WarmUp | None = None  # the GPU input's, once its pipeline is built (4.)
        # nvJPEG's start on a thread, joined before any graph capture (prewarm.py)
        decode_batch = (plan.batch_per_rank or 64) if plan.augment_on == "gpu" else 0  # (auto: not measured yet)
        self.prewarm = Prewarm(self.device, decode_batch=decode_batch, log=self.log).start()
        self.faults = FaultInjector.from_env(self.rank)
        self.hyp = build.hyperparameters(cfg, plan, folder.path, self.local_rank)
        torch.set_num_threads(plan.threads_per_rank)  # importing Ultralytics changed it
        build.seed(self.hyp, self.rank, world)
        # timed once per shape, before any graph is captured: the graphs replay what it chose
        torch.backends.cudnn.benchmark = self.device.type == "cuda" and bool(train.get("cudnn_benchmark", False))
        self._stamp("hyperparameters_and_seeds")
        self.data = build.dataset_info(self.hyp)
        self._stamp("dataset_check")

        # 1. the node's image cache, before the process group; the batch this GPU takes (train.batch_per_device=auto)
        self.caches = (training_input.image_caches(cfg, plan, self.data, int(self.hyp.imgsz), self.log)
                       if train["cache"] == "shared" else {})
        if plan.batch_pending:
            self.prewarm.join()  # the probe captures graphs
        measured = batch_probe.measure_batch(self, validation) if plan.batch_pending else None
        self._stamp("image_cache_and_batch")
        # 2. the process group and the heartbeat; the job's batch
        self.comm = Comm(self.rank, 1)
        self.heartbeat = NoHeartbeat()
        if plan.mode == "ddp":
            self.comm = Comm.start(plan.backend, plan.timeout_s, at_init=self.faults.at_init)
            if world > 1:
                self.heartbeat = Heartbeat(self.comm.store, self.rank, world, plan.timeout_s, folder)
        if measured is not None:
            plan = batch_probe.take_batch(self, measured)
        if self.device.type == "cuda" and plan.auto_batch.get("held_fraction"):  # a restart reads it from plan.json
            auto_batch.CudaMemory(self.device).hold(plan.auto_batch["held_fraction"])
        if self.rank == 0:
            build.save_args(self.hyp, folder.path)
            folder.env_file.write_text(environment_report())  # what a bug report needs (ddp-env prints the same)
        self._stamp("process_group_and_environment_report")
        # 3. the network, and the resume state
        self.state = TrainState(world_size=world, global_batch=plan.global_batch, device=self.device)
        checkpoint_io.remove_stale_temporaries(folder.weights)  # left by a writer that was SIGKILLed
        self.net, self.frozen = build.network(self.hyp, self.data, cfg["model"].get("weights"))
        expected = self.net.state_dict()
        resume, resumed_from = checkpoint_io.load_resumable(
            folder.weights / "last.pt", log=self.log,
            fits=lambda ckpt: checkpoint_io.mismatch(expected, _resume_part(ckpt, "model")))
        if resume is not None:
            self.net.load_state_dict(_resume_part(resume, "model"))  # the raw model in fp32: training continues exactly
        self.net = self.on_device(self.net)
        self.stride = max(int(self.net.stride.max()), 32)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16)
        if plan.mode == "ddp" and cfg["dist"]["sync_bn"]:
            self.net = nn.SyncBatchNorm.convert_sync_batchnorm(self.net)

        self._stamp("network")
        # 4. the loaders and the optimizer
        self.cores = training_input.bind_cores(cfg, plan, self.device, self.local_rank, self.detail)
        self.close_at = mosaic_closes_at(int(train["epochs"]), int(train["close_mosaic"]))
        self.train_dataset, self.gpu_input = training_input.training_set(
            cfg, plan, self.hyp, self.data, self.device, caches=self.caches, stride=self.stride,
            close_at=self.close_at, input_dtype=self.input_dtype, log=self.log, detail=self.detail)
        if self.kernels is not None and self.gpu_input is not None:  # the first batch's kernels, after the graphs'
            self.input_kernels = self.kernels.then(self.gpu_input.warm_up)
        self.generator = torch.Generator(device=self.device) if self.gpu_input else None  # the augmentation's draws
        self.sampler = EpochBatchSampler(
            len(self.train_dataset), plan.batch_per_rank, num_replicas=self.comm.world_size if plan.mode == "ddp" else 1,
            rank=self.rank if plan.mode == "ddp" else 0, seed=int(cfg["seed"]),
            fill_last=bool(plan.cuda_graphs) and self.device.type == "cuda",  # every step the graph's shape
        )
        loader = training_input.train_loader(cfg, plan, self.train_dataset, self.sampler, self.hyp, self.device,
                                             gpu_input=self.gpu_input, close_at=self.close_at, cores=self.cores)
        self.inputs = TrainInputs(
            loader, self.sampler, self.device, self._prepare,
            decode=self.gpu_input.decoded if self.gpu_input is not None else None,
            fetch_ahead=bool(loader_cfg.get("fetch_ahead", True)), persistent=bool(loader_cfg["persistent_workers"]),
            background=self.gpu_input is not None and bool(loader_cfg.get("fetch_ahead", True)),
        )
        self._stamp("train_data")
        self.val_loader = self.validator = None
        if validation:
            self.val_loader, self.validator = validation_build.validation_set(self)
        self._stamp("val_data")
        optim = cfg["optim"]
        self.optimizer = self.new_optimizer(self.net, plan.lr0)
        self.schedule = Schedule(self.optimizer, epochs=int(train["epochs"]), lrf=optim["lrf"], cos_lr=optim["cos_lr"],
                                 warmup_steps=plan.warmup_iterations or 0, warmup_bias_lr=optim["warmup_bias_lr"],
                                 warmup_momentum=optim["warmup_momentum"], momentum=optim["momentum"])

        # 5. class weights, the EMA, the training loss
        build.class_weights(self.net, self.hyp, self.train_dataset.labels, self.data["nc"])
        self.ema = build.ema(self.net)
        self.net.criterion, detection = training_criterion(self.net, sync_free=bool(train.get("sync_free_loss", True)))
        if not detection:
            self.log(f"WARNING: {type(self.net.criterion).__name__}: loss normalised per rank (not a YOLO detection "
                     "loss), and not sync-free")

        self._stamp("optimizer_ema_loss")
        if self.prewarm.started:
            self.prewarm.join()
            self._stamp("prewarm_join")
        if self.kernels is not None:
            self.triton_kernels()  # joined here, so that its wait is timed as its own part
            self._input_kernels()
            self._stamp("kernels_join")
        # 6. what the step calls: the whole step captured (one GPU), or the network graphed inside DDP
        self.step, self.model = step_build.build_step(self)

        self._stamp("graphs_and_step")
        # 7. the checkpoint's components (runs.py adds its hooks' and restores them: restore())
        self.components = {"model": self.net, "ema": EmaState(self.ema), "optimizer": self.optimizer,
                           "scaler": self.scaler, "train": self.state}
        self.resume, self.resumed_from = resume, resumed_from

    # --- helpers -------------------------------------------------------------------------------------------------
    def _stamp(self, part: str) -> None:
        """`part` of the set-up has ended (the stamps before it: rank 0's timeline)."""
        self.setup_stamps.append((part, time.time()))
        if self.device.type == "cuda":  # what each part left reserved on the GPU (train.batch_per_device=auto's room)
            self.setup_memory[part] = round(torch.cuda.memory_reserved(self.device) / 2**30, 2)

    def checkpointer(self, layout, complete, finish, extra: dict | None = None) -> Checkpointer:
        """The checkpointer over every component (and `extra` ones: the early stop's memory); `layout` and
        `complete` give Ultralytics' keys (ultralytics/checkpoint.py's Layout), `finish` the final weights."""
        return Checkpointer(self.folder.weights, {**self.components, **(extra or {})}, layout,
                            before_write=self.faults.at_checkpoint_write, complete=complete, finish=finish)

    def restore(self, checkpointer: Checkpointer) -> None:
        """Continue where the checkpoint stopped: every component's state; a resume at another world size starts
        the interrupted epoch again (its shards differ)."""
        if self.resume is None:
            return
        for name, component in checkpointer.components.items():
            if name != "model":  # loaded before the EMA copy and the graph capture
                part = _resume_part(self.resume, name)
                if part is not None:
                    component.load_state_dict(part)
        state, saved_world, saved_batch = self.state, self.state.world_size, self.state.global_batch
        self.state.resumed_from = self.resumed_from
        if saved_world != self.comm.world_size and state.step:
            self.log(f"world size changed ({saved_world} -> {self.comm.world_size}): restarting epoch {state.epoch + 1}")
            state.step = 0
            state.reset_loss()
        elif saved_batch != self.plan.global_batch and state.step:  # train.batch_per_device=auto measured again
            self.log(f"global batch changed ({saved_batch} -> {self.plan.global_batch}): restarting epoch "
                     f"{state.epoch + 1}")
            state.step = 0
            state.reset_loss()
        state.world_size, state.global_batch = self.comm.world_size, self.plan.global_batch
        self.log(f"resuming from {self.resumed_from} at epoch {state.epoch + 1}, step {state.step + 1}")

    def on_device(self, net: nn.Module) -> nn.Module:
        """`net` on this rank's device, channels_last on CUDA unless the hyperparameters turn it off."""
        net = net.to(self.device)
        if self.device.type == "cuda" and self.hyp.channels_last is not False:
            net = net.to(memory_format=torch.channels_last)  # Ultralytics' CUDA default (fast convolutions)
        return net

    def new_optimizer(self, net: nn.Module, lr: float) -> torch.optim.Optimizer:
        """optim.name over `net`'s parameter groups at `lr`, fused where optim.fused allows it."""
        optim = self.cfg["optim"]
        return fused_optimizer(build.optimizer(net, str(optim["name"]), lr, optim["momentum"], optim["weight_decay"]),
                               optim.get("fused", "auto"), self.device)

    @property
    def input_dtype(self) -> torch.dtype:
        """What the network's first layer computes in: the GPU pipeline writes its input in this type."""
        return self.amp_dtype or torch.float32

    def _prepare(self, raw, ni: int) -> dict:
        """A loader batch made ready for the step: augmented on the device once decoded (GpuInput.decoded, which the
        input pipeline calls first; the randomness a function of the seed, the step and the rank alone), or moved
        and scaled."""
        if self.gpu_input is not None:
            self.generator.manual_seed(sample_seed(int(self.cfg["seed"]), ni, self.rank))
            raw = self.gpu_input(raw, self.generator)  # carries MAX_TARGETS, read with its box count
        return to_device(raw, self.device, imgsz=self.hyp.imgsz, stride=self.stride, multi_scale=self.hyp.multi_scale)

    @property
    def step_input(self) -> tuple[torch.dtype, bool]:
        """(dtype, channels_last) of the images the step is given: the GPU pipeline writes the network's input type
        in channels_last, the CPU pipeline's arrive as float32 NCHW (to_device)."""
        on_gpu = self.plan.augment_on == "gpu"
        return (self.input_dtype if on_gpu else torch.float32), on_gpu

    def triton_kernels(self) -> bool:
        """Whether the graphs run the upsampling and the concatenations on Triton kernels: once their compilation has
        ended without an error (else PyTorch's kernels, said once)."""
        if self.kernels is None:
            return False
        warm = self.kernels.join()
        if warm.error is not None:
            self.log(f"WARNING: the training graphs' Triton kernels did not compile ({warm.error}); PyTorch's "
                     "upsampling and concatenations run instead")
            self.kernels = None
            return False
        return True

    def _input_kernels(self) -> None:
        """The GPU input's kernels, compiled before the first batch launches them (else it compiles them itself)."""
        warm, self.input_kernels = self.input_kernels, None
        if warm is not None and warm.join().error is not None:
            self.log(f"WARNING: the GPU input's Triton kernels did not compile ahead ({warm.error}); the first batch "
                     "compiles them")

    def close(self) -> None:
        """Stop every loader worker (they ignore SIGTERM until the rank has saved: signals.py, so they must be told),
        then leave the process group."""
        self.inputs.close()
        if self.val_loader is not None:
            self.val_loader.close()
        self.comm.close()


def _resume_part(ckpt: dict, name: str):
    return upgrade(ckpt).get(name)
