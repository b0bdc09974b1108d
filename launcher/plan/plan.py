"""The launch plan: a pure function of (resolved config, this node's hardware, dataset) -> LaunchPlan.

Everything a launch decides is decided here, once, before any process starts: topology, device, backend, batch and
learning rate, warmup length, loader workers and threads, the rendezvous, and the environment of the ranks. Every
problem is collected (checks.py words each with the key to change); `check_plan` splits them into errors and the
warnings a dry run shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from launcher.inputs.data import DatasetInfo
from launcher.inputs.ultralytics_files import ALLOW_VARIABLE
from launcher.machine.hardware import Hardware
from launcher.plan import checks, keys, ultralytics_values
from launcher.plan.batch import AUTO_BATCH_MULTIPLE, batch_fields, per_device_batch
from launcher.plan.checks import as_int
from launcher.plan.decisions import rank_decisions, val_batch_at
from launcher.plan.rendezvous import Rendezvous, rendezvous
from launcher.plan.task_rules import task_problems
from launcher.plan.environment import (CUDA_CONNECTIONS, bytecode_environment, cuda_environment,
                                      distributed_environment, interpreter_environment, offline_environment,
                                      thread_environment)
from launcher.problems import Problem

MODES = ("auto", "ddp", "dp", "single")
BACKENDS = ("auto", "nccl", "gloo")
MAX_AUTO_WORKERS = 16
# With the input on the GPU a worker only reads files (and decodes the few that nvJPEG cannot): four keep a rank fed.
MAX_AUTO_WORKERS_GPU_INPUT = 4


@dataclass(frozen=True)
class LaunchPlan:
    mode: str  # single | ddp | dp
    device: str  # cuda | cpu
    backend: str | None  # nccl | gloo; None without a process group
    nnodes: int
    node_rank: int
    nproc_per_node: int
    gpus_per_node: int
    devices_per_rank: int  # 1, or every GPU of the node under DataParallel
    world_size: int
    # the batch fields are None while train.batch_per_device=auto waits for the ranks to measure it (with_batch)
    batch_per_device: int | None
    batch_per_rank: int | None  # images per rank per optimizer step: batch_per_device x devices_per_rank x accumulate
    global_batch: int | None
    base_lr: float
    base_batch: int
    lr_scaling: str
    lr0: float | None  # the scaled lr0, capped at lr0_cap
    warmup_epochs: float | None  # None until the dataset size is known
    warmup_iterations: int | None
    warmup_images: int | None
    batches_per_epoch: int | None  # per rank
    train_images: int | None
    workers_per_rank: int
    threads_per_rank: int
    cpus_per_node: int
    rendezvous: Rendezvous
    max_restarts: int
    timeout_s: int
    env: dict = field(default_factory=dict)  # the ranks' environment, on top of the launcher's own
    notes: tuple[str, ...] = ()
    cuda_graphs: bool = False  # train.cuda_graphs resolved: the network's step replayed as CUDA graphs
    accumulate: int | None = 1  # micro-batches per optimizer step (train.accumulate, or from train.global_batch)
    # train.batch_per_device=auto on GPUs: the rule the ranks follow (fraction, multiple, divides, most), and once
    # they have measured, the batch and why (rank/step/auto_batch.py); {} for a batch given as a number
    auto_batch: dict = field(default_factory=dict)
    augment_on: str = "cpu"  # loader.augment_on resolved: gpu (bytes in, decode and augmentation on the GPU) | cpu
    # per split: the images Ultralytics uses and drops, and why (inputs/labels.py); train_images counts the usable
    images: dict = field(default_factory=dict)
    lr0_cap: float | None = None  # optim.lr0_cap: the most lr0 may be once scaled; None: no cap
    # decided for the ranks (decisions.py), so that none derives them again from the config
    amp: bool | str = False  # train.amp on CUDA (true: fp16 | bf16), false on the CPU
    fused_optimizer: bool = False  # optim.fused resolved (auto: on CUDA)
    cudnn_benchmark: bool = False  # train.cudnn_benchmark on CUDA
    cuda_graphs_required: bool = False  # train.cuda_graphs=true: a failed capture ends the run, no eager fallback
    graph_scope: str = "network"  # step: the whole step captured where the rank can | network: the network's only
    val_engine: str = "fast"  # val.engine resolved: fast | ultralytics
    val_batch_fixed: int | None = None  # val.batch as a number; None: auto (decisions.val_batch_at)
    val_cuda_graphs: bool = False  # the fast engine's forward replayed as CUDA graphs
    fused_bn_act: bool = False  # train.fused_bn_act resolved: the training graphs' Conv blocks fuse BatchNorm and SiLU
    task: str = "detect"  # what the run trains: detect | segment | pose | obb (inputs/model_task.py, task_rules.py)
    task_from: str | None = None  # the model file the task was read from

    @property
    def val_batch(self) -> int | None:
        """Images per validation forward at the training micro-batch (val_batch_at); None while it is pending."""
        return None if self.batch_pending else self.val_batch_at(self.micro_batch)

    def val_batch_at(self, micro_batch: int) -> int:
        """Images per validation forward for a training micro-batch (the auto batch's probe: each one it tries)."""
        return val_batch_at(self.val_batch_fixed, micro_batch)

    @property
    def micro_batch(self) -> int | None:
        """Images per rank per forward pass (what the CUDA graphs are captured for)."""
        return None if self.batch_pending else self.batch_per_rank // self.accumulate

    @property
    def batch_pending(self) -> bool:
        """train.batch_per_device=auto, not measured yet: the ranks choose it before their first step."""
        return self.batch_per_device is None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, cfg: dict | None = None) -> LaunchPlan:
        """The plan plan.json holds; the fields an older plan.json lacks decided from its run's `cfg`."""
        decided = {} if cfg is None else rank_decisions(cfg, device=d["device"], mode=d["mode"],
                                                        task=d.get("task", "detect"))
        d = {**decided, **d}
        d["rendezvous"] = Rendezvous(**d["rendezvous"])
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)


@dataclass(frozen=True)
class _Topology:
    mode: str
    device: str
    gpus: int
    nnodes: int
    node_rank: int
    nproc: int
    devices_per_rank: int
    world_size: int
    visible: str | None = None  # CUDA_VISIBLE_DEVICES for the ranks: the GPUs `device=` picked, None: as they are


def make_plan(
    cfg: dict,
    hw: Hardware,
    data: DatasetInfo | None = None,
    port_is_free: Callable[[int], bool] | None = None,
    task: str = "detect",
    task_from: str | None = None,
) -> tuple[LaunchPlan, list[Problem]]:
    """Decide the launch of a `task` model (read from the file `task_from`: inputs/model_task.py). Returns the plan
    (best effort, also when there are problems) and every problem found."""
    notes: list[str] = []
    problems: list[Problem] = checks.ultralytics_problems(hw, notes) + checks.unknown_key_problems(cfg, keys.known_keys())
    train, optim, loader, dist = cfg["train"], cfg["optim"], cfg["loader"], cfg["dist"]

    top = _topology(cfg, hw, problems, notes)
    backend = _backend(dist, top, hw, problems)

    # --- batch and learning rate -----------------------------------------------------------------------------
    devices = top.devices_per_rank * top.world_size
    problems += checks.batch_problems(train, device=top.device, mode=top.mode, devices=devices,
                                      multiple=AUTO_BATCH_MULTIPLE)
    train_images = data.train_images if data is not None else None
    batch_per_device, auto_batch = per_device_batch(train, device=top.device, devices_per_rank=top.devices_per_rank,
                                                    world_size=top.world_size, train_images=train_images,
                                                    problems=problems, notes=notes)
    batch = batch_fields(cfg, batch_per_device, devices_per_rank=top.devices_per_rank, world_size=top.world_size,
                         train_images=train_images, problems=problems, notes=notes)
    problems += checks.optim_problems(optim) + ultralytics_values.optimizer_problems(optim, batch)

    problems += checks.train_problems(train)
    problems += checks.step_problems(train, optim, device=top.device, mode=top.mode, hw=hw)
    augment_on, why = checks.augment_on(loader, train, top.device, max(1, hw.cpu_count // top.nproc), task=task)
    notes += [why] if why else []
    problems += task_problems(cfg, task, device=top.device)
    problems += checks.input_problems(loader, train, augment_on=augment_on)
    problems += checks.integration_problems(cfg.get("log") or {})
    problems += checks.val_problems(cfg.get("val") or {}, train)
    workers, threads = _loader_threads(loader, top, hw, problems, notes, augment_on)
    on_slurm = (cfg.get("launcher") or {}).get("name") == "slurm"
    meeting = rendezvous(dist, top, on_slurm, port_is_free, problems, notes)

    problems += checks.dist_problems(dist, device=top.device, mode=top.mode)
    timeout_s = as_int(dist.get("timeout_s"), "dist.timeout_s", problems, 1) or 600
    max_restarts = as_int(dist.get("max_restarts", 0), "dist.max_restarts", problems, 0) or 0

    single_node = top.nnodes == 1 and not on_slurm
    cache = Path(cfg["paths"]["cache"]).expanduser()
    problems += checks.paths_problems(cfg["paths"])
    setting = cfg["paths"].get("bytecode", "auto")
    bytecode = bytecode_environment(setting, cache, hw.bytecode_kept)
    if bytecode and setting == "auto":
        notes.append("torch's install holds no compiled bytecode for this Python, and none is written beside it: the "
                     f"ranks keep theirs in {bytecode['PYTHONPYCACHEPREFIX']}, compiled there beside the first run's "
                     "start, so that the runs after it import without compiling (paths.bytecode=null: compile at "
                     "every start)")
    env = {
        **offline_environment(cache),
        **interpreter_environment(bytecode),
        **thread_environment(threads),
        **distributed_environment(dist, single_node),
        **cuda_environment(train.get("cuda_connections", CUDA_CONNECTIONS), top.device),
        **({"CUDA_VISIBLE_DEVICES": top.visible} if top.visible else {}),
        # the ranks' own check of the release (rank/ultralytics/__init__.py) follows the launcher's switch
        **({ALLOW_VARIABLE: "1"} if hw.ultralytics_allowed else {}),
    }

    plan = LaunchPlan(
        mode=top.mode,
        device=top.device,
        backend=backend,
        nnodes=top.nnodes,
        node_rank=top.node_rank,
        nproc_per_node=top.nproc,
        gpus_per_node=top.gpus,
        devices_per_rank=top.devices_per_rank,
        world_size=top.world_size,
        **batch,
        train_images=train_images,
        workers_per_rank=workers,
        threads_per_rank=threads,
        cpus_per_node=max(1, hw.cpu_count),
        rendezvous=meeting,
        max_restarts=max_restarts,
        timeout_s=timeout_s,
        env=env,
        notes=tuple(notes),
        augment_on=augment_on,
        auto_batch=auto_batch,
        images=dict(data.checks) if data is not None else {},
        task_from=task_from,
        **rank_decisions(cfg, device=top.device, mode=top.mode, task=task),
    )
    return plan, problems


def with_batch(plan: LaunchPlan, cfg: dict, batch_per_device: int, why: dict) -> LaunchPlan:
    """The plan once the ranks have measured train.batch_per_device=auto: every field that follows the batch from
    batch_fields, as make_plan would have planned it for that number; `why` (the measurement) kept in auto_batch."""
    problems: list[Problem] = []
    notes: list[str] = []
    fields = batch_fields(cfg, batch_per_device, devices_per_rank=plan.devices_per_rank, world_size=plan.world_size,
                          train_images=plan.train_images, problems=problems, notes=notes)
    if problems:  # the rule (auto_batch's divides) makes every batch it allows plannable
        raise ValueError(f"batch_per_device={batch_per_device}: " + "; ".join(p.message for p in problems))
    return replace(plan, **fields, notes=plan.notes + tuple(notes),
                   auto_batch={**plan.auto_batch, **why, "batch_per_device": batch_per_device})


def _topology(cfg: dict, hw: Hardware, problems: list[Problem], notes: list[str]) -> _Topology:
    """Mode, device, nodes and ranks; and whether this machine has the GPUs asked for."""
    gpus, visible = _gpus(cfg, hw, problems)
    device = "cuda" if gpus > 0 else "cpu"
    mode = cfg.get("mode", "auto")
    if not checks.one_of(mode, MODES, "mode", problems):
        mode = "auto"
    nnodes = as_int(cfg.get("nnodes", 1), "nnodes", problems, 1) or 1
    node_rank = as_int(cfg.get("node_rank", 0), "node_rank", problems, 0) or 0
    if node_rank >= nnodes:
        problems.append(Problem(f"node_rank={node_rank} with nnodes={nnodes}: node_rank counts from 0 to nnodes-1"))
    if mode == "auto" and gpus > 1 and cfg["dist"].get("backend", "auto") == "auto" and not hw.nccl_available and hw.gpu_count:
        # DDP on GPUs needs NCCL (gloo on CUDA tensors is far slower than DataParallel on one node)
        mode = "dp"
        notes.append("WARNING: DDP cannot start here (this torch build has no NCCL): DataParallel over the GPUs instead")

    raw_nproc = cfg.get("nproc")
    if mode == "dp":
        # One process drives every GPU of the node (or the CPU as a single device, which only tests the path).
        if raw_nproc not in (None, 1):
            problems.append(Problem(f"mode=dp runs one process per node (it drives all GPUs); nproc={raw_nproc} is not 1"))
        if nnodes > 1:
            problems.append(Problem("mode=dp is single-node (DataParallel); use mode=ddp across nodes"))
        nproc, devices_per_rank = 1, max(gpus, 1)
        if gpus == 0:
            notes.append("mode=dp on the CPU: DataParallel over one device (exercises the path; no speedup)")
    else:
        devices_per_rank = 1
        if raw_nproc is None:
            nproc = gpus if gpus > 0 else 1
        else:
            nproc = as_int(raw_nproc, "nproc", problems, 1) or 1
            if gpus > 0 and nproc != gpus:
                problems.append(
                    Problem(
                        f"nproc={nproc} with gpus={gpus}: ddp-launch runs one rank per GPU. "
                        f"Set nproc={gpus} (or leave nproc unset), or gpus={nproc}"
                    )
                )
    world_size = nnodes * nproc
    if mode == "auto":
        mode = "ddp" if world_size > 1 else "single"
    if mode == "single" and world_size > 1:
        problems.append(
            Problem(f"mode=single runs one process, but nnodes x nproc = {nnodes} x {nproc} = {world_size}; use mode=ddp")
        )

    # hardware checks are environment problems: a dry run shows the plan anyway
    if cfg.get("device") is not None:
        pass  # _gpus checked the GPUs device= names
    elif gpus > 0 and hw.gpu_count == 0:
        problems.append(
            Problem(f"gpus={gpus} but {hw.describe_gpus()} on this machine; train on the CPU with gpus=0", environment=True)
        )
    elif gpus > hw.gpu_count:
        problems.append(
            Problem(
                f"gpus={gpus} but this node has {hw.gpu_count} visible GPU(s): {hw.describe_gpus()}. "
                f"Use gpus={hw.gpu_count} or gpus=auto",
                environment=True,
            )
        )
    return _Topology(mode, device, gpus, nnodes, node_rank, nproc, devices_per_rank, world_size, visible)


def _gpus(cfg: dict, hw: Hardware, problems: list[Problem]) -> tuple[int, str | None]:
    """(GPUs per node, the ranks' CUDA_VISIBLE_DEVICES or None): from `device` (Ultralytics' GPU indices, or cpu)
    when it is set, else `gpus` (a number, or auto: every visible GPU)."""
    gpus, device = cfg.get("gpus", "auto"), cfg.get("device")
    if device is None:
        return (hw.gpu_count if gpus == "auto" else (as_int(gpus, "gpus", problems) or 0)), None
    if device == "cpu":
        chosen: list[int] = []
    elif isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        chosen = [device]
    elif isinstance(device, list) and device and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                     for i in device):
        chosen = list(dict.fromkeys(device))
    else:
        problems.append(Problem(f"device={device!r}: expected GPU indices (device=0 or device=0,1) or device=cpu"))
        return 0, None
    device = ",".join(map(str, chosen)) or "cpu"  # as the user typed it (device=0,1), in the messages below
    if gpus not in ("auto", len(chosen)):
        problems.append(Problem(f"device={device} picks {len(chosen)} GPU(s) but gpus={gpus}: set one of them"))
    if (cfg.get("launcher") or {}).get("name") == "slurm" and chosen:
        problems.append(Problem(f"device={device}: under launcher=slurm the allocation picks the GPUs; ask for "
                                f"{len(chosen)} per node with slurm.gpus_per_node={len(chosen)}"))
        return len(chosen), None
    missing = [i for i in chosen if i >= hw.gpu_count]
    if missing and hw.gpu_count:
        problems.append(Problem(f"device={device}: this node has {hw.gpu_count} visible GPU(s) "
                                f"({hw.describe_gpus()}); GPU {', '.join(map(str, missing))} is not one of them",
                                environment=True))
    if not chosen:
        return 0, None
    given = [v.strip() for v in hw.cuda_visible.split(",")] if hw.cuda_visible else None
    visible = ",".join(given[i] if given and i < len(given) else str(i) for i in chosen)
    return len(chosen), visible


def _backend(dist: dict, top: _Topology, hw: Hardware, problems: list[Problem]) -> str | None:
    """The process group's backend; None without one (a single process, DataParallel)."""
    requested = dist.get("backend", "auto")
    if not checks.one_of(requested, BACKENDS, "dist.backend", problems):
        requested = "auto"
    if top.mode != "ddp":
        return None
    backend = ("nccl" if top.device == "cuda" else "gloo") if requested == "auto" else requested
    if backend == "nccl" and top.device == "cpu":
        problems.append(Problem("dist.backend=nccl needs GPUs; on the CPU use dist.backend=gloo (or auto)"))
    if backend == "nccl" and top.device == "cuda" and hw.gpu_count and not hw.nccl_available:
        problems.append(Problem("this torch build has no NCCL; use dist.backend=gloo", environment=True))
    return backend


def _loader_threads(loader: dict, top: _Topology, hw: Hardware, problems: list[Problem], notes: list[str],
                    augment_on: str = "cpu"):
    """(loader workers, math threads) per rank, from the cores of the node."""
    cpus = max(1, hw.cpu_count)
    cores_per_rank = max(1, cpus // top.nproc)
    requested = loader.get("workers", "auto")
    if requested == "auto":
        # A GPU rank keeps a quarter of its cores, at least 2, for its training process (rank/data/affinity.py): its
        # main thread, the pin-memory thread copying every batch into page-locked memory, NCCL's and the monitor's
        # threads; fewer leave it short of cores (docs/benchmarks/README.md, section 3).
        reserved = max(2, cores_per_rank // 4) if top.device == "cuda" and cores_per_rank >= 4 else 1
        most = MAX_AUTO_WORKERS_GPU_INPUT if augment_on == "gpu" and top.device == "cuda" else MAX_AUTO_WORKERS
        workers = min(most, max(0, cores_per_rank - reserved))
    else:
        workers = as_int(requested, "loader.workers", problems, 0) or 0
    if isinstance(loader.get("prefetch_factor"), int) and loader["prefetch_factor"] < 1:
        problems.append(Problem("loader.prefetch_factor must be >= 1"))
    # On the CPU the rank's own math is the bottleneck and workers mostly wait, so the rank keeps all its cores;
    # on a GPU node the cores are left to the workers that feed the GPU.
    threads = cores_per_rank if top.device == "cpu" else max(1, cores_per_rank - workers)
    if top.mode == "dp" and top.device == "cuda":
        threads = max(threads, 2)  # DataParallel's host work (scatter, replicate, gather) is per GPU
    if workers * top.nproc > cpus:
        notes.append(f"{workers} workers x {top.nproc} ranks exceed the {cpus} usable cores")
    return workers, threads
