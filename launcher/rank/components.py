"""What a rank builds before its first step, in the order it must be built (each line says why it stands there):

0. nvJPEG's warm-up, and the compilation of the training graphs' Triton kernels (kernels/kernels.py), then of the
   GPU input's (once 4 has built it), each on a thread beside everything up to 5 (startup/prewarm.py), joined before
   any graph is captured;
1. the node-shared image cache, before the process group (its build may outlast dist.timeout_s: nobody waits for it
   in a timed barrier);
   with train.batch_per_device=auto, this GPU's largest batch, measured before the process group too (the loss's
   normaliser would all-reduce, and ranks measure different sizes) on a network, optimizer, EMA and CUDA graphs of
   its own, built by the run's own functions and freed before the run's are built: everything below is built for the
   batch chosen (build_steps/batch_probe.py);
2. the process group, and the heartbeat over its store; the job's batch, the smallest any rank measured;
3. the network, from model.cfg and/or model.weights, with the resume state loaded before anything copies it
   (build_steps/model_build.py);
4. the training loader (build_steps/training_input.py), the validation loader and validator
   (build_steps/validation_build.py: the validator copies the hyperparameters once max_det is set; the fast one
   reads the loader once, at the first validation);
5. the optimizer on the bare network, class weights, then the EMA copy (it carries them), then the training loss
   (the EMA keeps Ultralytics' own, which validation uses, collective-free);
6. what the step calls (build_steps/step_build.py): on one GPU the whole step's forward, loss and backward captured
   (step/captured_step.py); elsewhere CUDA graphs captured on the bare network, then DDP or DataParallel around it;
7. the checkpoint's components, whose saved states (optimizer, scaler, EMA, position) restore() loads.

Each step is one call to a function that takes what it needs and returns what it built; `_part` stamps each part's
end (and, on CUDA, what it left reserved) for rank 0's timeline.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from launcher.machine.environment_report import report as environment_report
from launcher.plan.plan import LaunchPlan
from launcher.plan.settings import Settings
from launcher.plan.task_rules import rules
from launcher.rank.build_steps import batch_probe, model_build, step_build, training_input, validation_build
from launcher.rank.data.pipeline import to_device
from launcher.rank.data.sampler import mosaic_closes_at, sample_seed
from launcher.rank.group.dist import Comm, rank_info
from launcher.rank.group.faults import FaultInjector
from launcher.rank.group.heartbeat import Heartbeat, NoHeartbeat
from launcher.rank.group.lines import rank_lines
from launcher.rank.kernels import kernels
from launcher.rank.loop.state import Checkpointer, TrainState
from launcher.rank.startup.prewarm import Prewarm
from launcher.rank.step import auto_batch
from launcher.rank.step import triton_modules
from launcher.rank.step.optimizer import Schedule
from launcher.rank.ultralytics import build
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
        self.settings = settings = Settings.of(cfg)  # what the rank reads of the config
        self.rank, self.local_rank, self.world = rank_info()
        self.log, self.detail = rank_lines(self.rank)  # a line for the console; a diagnostic
        self.device = torch.device("cuda", self.local_rank) if plan.device == "cuda" else torch.device("cpu")
        self.setup_stamps: list[tuple[str, float]] = []  # where the start-up went (summary.json's timeline)
        self.setup_memory: dict[str, float] = {}
        with self._part("cuda_init"):
            start_cuda(self.device)
        self.amp_dtype = amp_dtype(plan)
        # 0. the training graphs' Triton kernels and nvJPEG's start, each on a thread from the start
        self.kernels = training_kernels(self.device, self.input_dtype, plan)
        self.input_kernels: kernels.WarmUp | None = None  # the GPU input's, once its pipeline is built (4.)
        self.prewarm = Prewarm(self.device, decode_batch=decode_batch(plan), log=self.log).start()
        self.faults = FaultInjector.from_env(self.rank)
        with self._part("hyperparameters_and_seeds"):
            self.hyp = seeded_hyperparameters(settings, plan, folder, self.local_rank, self.rank, self.world)
        with self._part("dataset_check"):
            self.data = build.dataset_info(self.hyp)
        # 1. the node's image cache, before the process group; the batch this GPU takes (train.batch_per_device=auto)
        with self._part("image_cache_and_batch"):
            self.caches = (training_input.image_caches(settings, plan, self.data, int(self.hyp.imgsz), self.log)
                           if settings.train.cache == "shared" else {})
            measured = batch_probe.measure_batch(self, validation) if plan.batch_pending else None
        # 2. the process group and the heartbeat; the job's batch
        with self._part("process_group_and_environment_report"):
            self.comm, self.heartbeat = process_group(plan, self.rank, self.world, folder, self.faults)
            self.plan = plan = batch_probe.take_batch(self, measured) if measured is not None else plan
            hold_memory(self.device, plan)
            if self.rank == 0:
                write_records(self.hyp, folder)
        # 3. the network, and the resume state
        with self._part("network"):
            self.state = TrainState(world_size=self.world, global_batch=plan.global_batch, device=self.device)
            self.net, self.frozen, self.resume, self.resumed_from = model_build.resumable_network(
                self.hyp, self.data, settings.model.weights, folder, self.device, log=self.log,
                sync_bn=plan.mode == "ddp" and bool(settings.dist.sync_bn))
            self.stride, self.scaler = max(int(self.net.stride.max()), 32), model_build.scaler(self.amp_dtype)
        # 4. the training and validation loaders, the validator
        with self._part("train_data"):
            self._training_input()
        with self._part("val_data"):
            self.val_loader, self.validator = validation_build.validation_set(self) if validation else (None, None)
        # 5. the optimizer on the bare network, class weights, then the EMA copy (it carries them), the training loss
        with self._part("optimizer_ema_loss"):
            self.optimizer = model_build.optimizer(self.net, settings.optim, plan.lr0, plan.fused_optimizer,
                                                 self.device)
            self.schedule = lr_schedule(self.optimizer, settings, plan)
            build.class_weights(self.net, self.hyp, getattr(self.train_dataset, "labels", None), self.data["nc"])
            self.ema = model_build.ema_and_loss(self.net, bool(settings.train.sync_free_loss), log=self.log)
        self._join_warm_ups()
        # 6. what the step calls: the whole step captured (one GPU), or the network graphed inside DDP
        with self._part("graphs_and_step"):
            self.step, self.model = step_build.build_step(self)
        # 7. the checkpoint's components (runs.py adds its hooks' and restores them: restore())
        self.components = {"model": self.net, "ema": EmaState(self.ema), "optimizer": self.optimizer,
                           "scaler": self.scaler, "train": self.state}

    def _training_input(self) -> None:
        """Step 4's training half: this process's cores, the training set (and the GPU input), the sampler and the
        loop's batches; the GPU input's kernels compiled after the graphs' on the same thread."""
        settings, plan = self.settings, self.plan
        self.cores = training_input.bind_cores(settings, plan, self.device, self.local_rank, self.detail)
        self.close_at = (mosaic_closes_at(int(settings.train.epochs), int(settings.train.close_mosaic))
                         if rules(plan.task).mosaic else None)  # a classifier's set has no mosaic to close
        self.train_dataset, self.gpu_input = training_input.training_set(
            settings, plan, self.hyp, self.data, self.device, caches=self.caches, stride=self.stride,
            close_at=self.close_at, input_dtype=self.input_dtype, log=self.log, detail=self.detail)
        if self.kernels is not None and self.gpu_input is not None:  # the first batch's kernels, after the graphs'
            self.input_kernels = self.kernels.then(self.gpu_input.warm_up)
        self.generator = torch.Generator(device=self.device) if self.gpu_input else None  # the augmentation's draws
        self.sampler, self.inputs = training_input.train_inputs(
            settings, plan, self.train_dataset, self.hyp, self.device, rank=self.rank, world_size=self.comm.world_size,
            gpu_input=self.gpu_input, close_at=self.close_at, cores=self.cores, prepare=self._prepare)

    def _join_warm_ups(self) -> None:
        """nvJPEG's start and the Triton kernels' compilation joined before any graph is captured, each wait timed
        as its own part."""
        if self.prewarm.started:
            with self._part("prewarm_join"):
                self.prewarm.join()
        if self.kernels is not None:
            with self._part("kernels_join"):
                self.triton_kernels()
                self._input_kernels()

    # --- helpers -------------------------------------------------------------------------------------------------
    @contextmanager
    def _part(self, part: str):
        """A part of the set-up, stamped when it ends (the stamps before it: rank 0's timeline)."""
        yield
        self.setup_stamps.append((part, time.time()))
        if self.device.type == "cuda":  # what each part left reserved on the GPU (train.batch_per_device=auto's room)
            self.setup_memory[part] = round(torch.cuda.memory_reserved(self.device) / 2**30, 2)

    def checkpointer(self, layout, complete, finish, extra: dict | None = None) -> Checkpointer:
        """The checkpointer over every component (and `extra` ones: the early stop's memory); `layout` and
        `complete` give Ultralytics' keys (ultralytics/checkpoint.py's Layout), `finish` the final weights."""
        return Checkpointer(self.folder.weights, {**self.components, **(extra or {})}, layout,
                            before_write=self.faults.at_checkpoint_write, complete=complete, finish=finish,
                            on_save=self.faults.at_save)

    def restore(self, checkpointer: Checkpointer) -> None:
        """Continue where the checkpoint stopped: every component's state; a resume at another world size starts
        the interrupted epoch again (its shards differ)."""
        if self.resume is None:
            return
        for name, component in checkpointer.components.items():
            if name != "model":  # loaded before the EMA copy and the graph capture
                part = model_build.resume_part(self.resume, name)
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

    @property
    def input_dtype(self) -> torch.dtype:
        """What the network's first layer computes in: the GPU pipeline writes its input in this type."""
        return self.amp_dtype or torch.float32

    def _prepare(self, raw, ni: int) -> dict:
        """A loader batch made ready for the step: augmented on the device once decoded (GpuInput.decoded, which the
        input pipeline calls first; the randomness a function of the seed, the step and the rank alone), or moved
        and scaled."""
        if self.gpu_input is not None:
            self.generator.manual_seed(sample_seed(int(self.settings.seed), ni, self.rank))
            raw = self.gpu_input(raw, self.generator)  # carries MAX_TARGETS, read with its box count
        return to_device(raw, self.device, imgsz=self.hyp.imgsz, stride=self.stride, multi_scale=self.hyp.multi_scale)

    @property
    def step_input(self) -> tuple[torch.dtype, bool]:
        """(dtype, channels_last) of the images the step is given: the GPU pipeline writes the network's input type
        in channels_last, the CPU pipeline's arrive as float32 NCHW (to_device)."""
        on_gpu = self.plan.augment_on == "gpu"
        return (self.input_dtype if on_gpu else torch.float32), on_gpu

    def triton_parts(self) -> tuple[str, ...]:
        """What the training graphs run on Triton kernels (step/triton_modules.py's parts): the upsampling and the
        concatenations, and the fused BatchNorm and SiLU where the plan says (train.fused_bn_act); none where the
        kernels did not compile."""
        if not self.triton_kernels():
            return ()
        return triton_modules.PARTS if self.plan.fused_bn_act else triton_modules.COPIES

    def triton_kernels(self) -> bool:
        """Whether the graphs run the upsampling and the concatenations on Triton kernels: once their compilation has
        ended without an error (else PyTorch's kernels, said once)."""
        if self.kernels is None:
            return False
        warm = self.kernels.join()
        if warm.error is not None:
            self.log(f"WARNING: the training graphs' Triton kernels did not compile ({warm.error}); PyTorch's "
                     "upsampling, concatenations, BatchNorm and SiLU run instead")
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



# --- the constructor's smaller steps ---------------------------------------------------------------------------------
def start_cuda(device: torch.device) -> None:
    """The driver and the CUDA context, made here to be timed as their own part."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.empty(1, device=device)


def amp_dtype(plan: LaunchPlan) -> torch.dtype | None:
    """The autocast type the plan decided (bf16 or fp16), None without mixed precision."""
    return (torch.bfloat16 if plan.amp == "bf16" else torch.float16) if plan.amp else None


def training_kernels(device: torch.device, dtype: torch.dtype, plan: LaunchPlan) -> kernels.WarmUp | None:
    """The training graphs' Triton kernels (step/triton_modules.py), compiled on a thread from the start: on a fresh
    machine (no Triton cache) compiling them takes longer than the set-up's other parts."""
    names = kernels.TRAINING + (("bn_act",) if plan.fused_bn_act else ())
    return kernels.WarmUp(device, dtype, names) if device.type == "cuda" and plan.cuda_graphs else None


def decode_batch(plan: LaunchPlan) -> int:
    """The batch nvJPEG's start is warmed for: the GPU input's (before an auto batch is measured, a guess), else 0."""
    return (plan.batch_per_rank or 64) if plan.augment_on == "gpu" else 0


def seeded_hyperparameters(settings: Settings, plan: LaunchPlan, folder: RunFolder, local_rank: int, rank: int,
                           world: int):
    """Ultralytics' hyperparameters for this rank, its seeds set, and torch's threads and cuDNN's autotuning as the
    plan decided (timed once per shape, before any graph is captured: the graphs replay what it
    chose)."""
    hyp = build.hyperparameters(settings, plan, folder.path, local_rank)
    torch.set_num_threads(plan.threads_per_rank)  # importing Ultralytics changed it
    build.seed(hyp, rank, world)
    torch.backends.cudnn.benchmark = plan.cudnn_benchmark
    return hyp


def process_group(plan: LaunchPlan, rank: int, world: int, folder: RunFolder, faults: FaultInjector):
    """(comm, heartbeat): the process group under DDP, and the heartbeat over its store with more than one rank; a
    single-process Comm and no heartbeat otherwise."""
    if plan.mode != "ddp":
        return Comm(rank, 1), NoHeartbeat()
    comm = Comm.start(plan.backend, plan.timeout_s, at_init=faults.at_init)
    return comm, (Heartbeat(comm.store, rank, world, plan.timeout_s, folder) if world > 1 else NoHeartbeat())


def hold_memory(device: torch.device, plan: LaunchPlan) -> None:
    """The GPU memory train.batch_per_device=auto leaves to others held back (a restart reads it from plan.json)."""
    if device.type == "cuda" and plan.auto_batch.get("held_fraction"):
        auto_batch.CudaMemory(device).hold(plan.auto_batch["held_fraction"])


def write_records(hyp, folder: RunFolder) -> None:
    """Rank 0's args.yaml and env.txt (what a bug report needs: ddp-env prints the same)."""
    build.save_args(hyp, folder.path)
    folder.env_file.write_text(environment_report())


def lr_schedule(optimizer, settings: Settings, plan: LaunchPlan) -> Schedule:
    optim = settings.optim
    return Schedule(optimizer, epochs=int(settings.train.epochs), lrf=optim.lrf, cos_lr=optim.cos_lr,
                    warmup_steps=plan.warmup_iterations or 0, warmup_bias_lr=optim.warmup_bias_lr,
                    warmup_momentum=optim.warmup_momentum, momentum=optim.momentum)
