"""The launch plan: a pure function of (resolved config, detected hardware, dataset, model) -> LaunchPlan.

Everything a launch decides is decided here, once, before any process starts: topology, device, backend, batch and
learning rate, warmup length, loader workers and threads, the rendezvous, and the environment of the ranks.
`check_plan` is the one place that validates it; every problem is collected (not just the first) and worded so the
user knows which key to change.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from launcher import lr as lrmod
from launcher.data import DatasetInfo
from launcher.hardware import Hardware
from launcher.models import ModelSpec
from launcher.problems import Problem
from launcher.runenv import NCCL_DEBUG_LEVELS, TORCH_DEBUG_LEVELS, distributed_environment, thread_environment

MODES = ("auto", "ddp", "dp", "single")
BACKENDS = ("auto", "nccl", "gloo")
AMP_VALUES = (True, False, "bf16")
CACHE_VALUES = (False, "ram", "disk", "shared")
OPTIMIZERS = ("sgd", "adamw")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")  # torch.compile's
FUSED_VALUES = ("auto", True, False)
GRAPHS_VALUES = ("auto", True, False)
FALLBACKS = ("none", "dp")  # what mode=auto does when DDP fails to start
MULTI_NODE_DEFAULT_PORT = 29500  # torchrun's default; every node must agree on it, so it cannot be picked at random
MAX_AUTO_WORKERS = 16

# Ultralytics train arguments that ddp-launch sets from its own keys; train.extra may not override them.
OWNED_ULTRALYTICS_ARGS = {
    "model": "model=...",
    "data": "data=...",
    "epochs": "train.epochs",
    "batch": "train.batch_per_device",
    "imgsz": "train.imgsz",
    "device": "gpus",
    "workers": "loader.workers",
    "optimizer": "optim.name",
    "lr0": "optim.base_lr",
    "lrf": "optim.lrf",
    "momentum": "optim.momentum",
    "weight_decay": "optim.weight_decay",
    "warmup_epochs": "optim.warmup_epochs",
    "warmup_momentum": "optim.warmup_momentum",
    "warmup_bias_lr": "optim.warmup_bias_lr",
    "cos_lr": "optim.cos_lr",
    "nbs": "optim.base_batch (ddp-launch turns Ultralytics' accumulation off: README)",
    "amp": "train.amp",
    "cache": "train.cache",
    "close_mosaic": "train.close_mosaic",
    "patience": "train.patience",
    "seed": "seed",
    "resume": "resume",
    "save_period": "train.save_period",
    "val": "train.val_interval",
    "project": "hydra.run.dir",
    "name": "hydra.run.dir",
    "save_dir": "hydra.run.dir",
    "exist_ok": "hydra.run.dir",
    "pretrained": "model.weights",
    "mode": "(not applicable)",
    "task": "(ddp-launch trains detectors)",
    "rect": "(rectangular batches cannot be shuffled across ranks)",
    "time": "train.epochs",
}


@dataclass(frozen=True)
class Rendezvous:
    kind: str  # standalone: c10d on localhost:0 | static: master_addr:master_port | none: a single process
    addr: str = ""
    port: int = 0


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
    batch_per_device: int
    batch_per_rank: int
    global_batch: int
    base_lr: float
    base_batch: int
    lr_scaling: str
    lr0: float
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
    env: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    cuda_graphs: bool = False  # train.cuda_graphs resolved: the network's step replayed as CUDA graphs (graphed.py)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LaunchPlan:
        d = dict(d)
        d["rendezvous"] = Rendezvous(**d["rendezvous"])
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)


def _as_int(value, key: str, problems: list[Problem], minimum: int = 0) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(Problem(f"{key}={value!r}: expected an integer >= {minimum}"))
        return None
    if value < minimum:
        problems.append(Problem(f"{key}={value}: must be >= {minimum}"))
        return None
    return value


def _requested_gpus(cfg: dict, hw: Hardware, problems: list[Problem]) -> int:
    gpus = cfg.get("gpus", "auto")
    if gpus == "auto":
        return hw.gpu_count
    n = _as_int(gpus, "gpus", problems)
    return 0 if n is None else n


def make_plan(
    cfg: dict,
    hw: Hardware,
    data: DatasetInfo | None = None,
    port_is_free: Callable[[int], bool] | None = None,
) -> tuple[LaunchPlan, list[Problem]]:
    """Decide the launch. Returns the plan (best effort, also when there are problems) and every problem found."""
    problems: list[Problem] = []
    notes: list[str] = []
    train, optim, loader, dist = cfg["train"], cfg["optim"], cfg["loader"], cfg["dist"]

    # --- topology -------------------------------------------------------------------------------------------
    gpus = _requested_gpus(cfg, hw, problems)
    device = "cuda" if gpus > 0 else "cpu"
    mode = cfg.get("mode", "auto")
    if mode not in MODES:
        problems.append(Problem(f"mode={mode!r}: expected one of {', '.join(MODES)}"))
        mode = "auto"
    nnodes = _as_int(cfg.get("nnodes", 1), "nnodes", problems, 1) or 1
    node_rank = _as_int(cfg.get("node_rank", 0), "node_rank", problems, 0) or 0
    if node_rank >= nnodes:
        problems.append(Problem(f"node_rank={node_rank} with nnodes={nnodes}: node_rank counts from 0 to nnodes-1"))

    backend_req = dist.get("backend", "auto")
    if backend_req not in BACKENDS:
        problems.append(Problem(f"dist.backend={backend_req!r}: expected one of {', '.join(BACKENDS)}"))
        backend_req = "auto"
    if mode == "auto" and gpus > 1 and backend_req == "auto" and not hw.nccl_available and hw.gpu_count:
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
            nproc = _as_int(raw_nproc, "nproc", problems, 1) or 1
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

    # --- hardware checks (environment problems: a dry run shows the plan anyway) ------------------------------
    if gpus > 0 and hw.gpu_count == 0:
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

    # --- backend ---------------------------------------------------------------------------------------------
    backend: str | None = None
    if mode == "ddp":
        backend = ("nccl" if device == "cuda" else "gloo") if backend_req == "auto" else backend_req
        if backend == "nccl" and device == "cpu":
            problems.append(Problem("dist.backend=nccl needs GPUs; on the CPU use dist.backend=gloo (or auto)"))
        if backend == "nccl" and device == "cuda" and hw.gpu_count and not hw.nccl_available:
            problems.append(Problem("this torch build has no NCCL; use dist.backend=gloo", environment=True))

    # --- batch and learning rate -----------------------------------------------------------------------------
    batch_per_device = _as_int(train.get("batch_per_device"), "train.batch_per_device", problems, 1) or 1
    batch_per_rank = batch_per_device * devices_per_rank
    global_batch = batch_per_rank * world_size
    base_batch = _as_int(optim.get("base_batch"), "optim.base_batch", problems, 1) or 1
    base_lr = optim.get("base_lr")
    if not isinstance(base_lr, (int, float)) or isinstance(base_lr, bool) or base_lr <= 0:
        problems.append(Problem(f"optim.base_lr={base_lr!r}: expected a number > 0"))
        base_lr = 0.01
    rule = optim.get("lr_scaling", "linear")
    if rule not in lrmod.LR_RULES:
        problems.append(Problem(f"optim.lr_scaling={rule!r}: expected one of {', '.join(lrmod.LR_RULES)}"))
        rule = "none"
    lr0 = lrmod.scaled_lr(float(base_lr), base_batch, global_batch, rule)
    if str(optim.get("name", "")).lower() not in OPTIMIZERS:
        problems.append(
            Problem(
                f"optim.name={optim.get('name')!r}: expected sgd or adamw "
                "(Ultralytics' `auto` picks its own optimizer and ignores lr0)"
            )
        )

    epochs = _as_int(train.get("epochs"), "train.epochs", problems, 1) or 1
    train_images = data.train_images if data is not None else None
    batches_per_epoch = warmup = None
    if train_images:
        per_rank = math.ceil(train_images / world_size)  # DistributedSampler pads to equal shards
        batches_per_epoch = math.ceil(per_rank / batch_per_rank)
        warmup = lrmod.warmup_length(
            warmup_epochs=float(optim.get("warmup_epochs", 0.0)),
            warmup_images=optim.get("warmup_images"),
            epochs=epochs,
            batches_per_epoch=batches_per_epoch,
            global_batch=global_batch,
        )
        if train_images < global_batch:
            notes.append(f"the global batch ({global_batch}) is larger than the training set ({train_images} images)")

    # --- other training keys ---------------------------------------------------------------------------------
    if train.get("amp") not in AMP_VALUES:
        problems.append(Problem(f"train.amp={train.get('amp')!r}: expected true, false or bf16"))
    if train.get("cache") not in CACHE_VALUES:
        problems.append(Problem(f"train.cache={train.get('cache')!r}: expected false, ram, disk or shared"))
    _as_int(train.get("val_interval"), "train.val_interval", problems, 1)
    imgsz = _as_int(train.get("imgsz"), "train.imgsz", problems, 32)
    if imgsz and imgsz % 32:
        problems.append(Problem(f"train.imgsz={imgsz}: must be a multiple of 32 (the model's largest stride)"))
    _as_int(train.get("close_mosaic"), "train.close_mosaic", problems, 0)
    _as_int(train.get("patience"), "train.patience", problems, 1)
    problems += _check_extra(train.get("extra") or {})
    problems += _check_step(train, optim, device=device, mode=mode, hw=hw)

    # --- loader and threads ----------------------------------------------------------------------------------
    cpus = max(1, hw.cpu_count)
    cores_per_rank = max(1, cpus // nproc)
    workers_req = loader.get("workers", "auto")
    if workers_req == "auto":
        # A GPU rank keeps a quarter of its cores, at least 2, for its training process (affinity.py): its main
        # thread, the pin-memory thread copying every batch into page-locked memory, NCCL's and the monitor's
        # threads. On an H200 with 16 cores, 12 workers trained 6 % faster than 14 (GPU 97 % busy against 88 %):
        # 14 workers left the training process short of cores (docs/benchmarks/README.md, section 3).
        reserved = max(2, cores_per_rank // 4) if device == "cuda" and cores_per_rank >= 4 else 1
        workers = min(MAX_AUTO_WORKERS, max(0, cores_per_rank - reserved))
    else:
        workers = _as_int(workers_req, "loader.workers", problems, 0) or 0
    if isinstance(loader.get("prefetch_factor"), int) and loader["prefetch_factor"] < 1:
        problems.append(Problem("loader.prefetch_factor must be >= 1"))
    # On the CPU the rank's own math is the bottleneck and workers mostly wait, so the rank keeps all its cores;
    # on a GPU node the cores are left to the workers that feed the GPU.
    threads = cores_per_rank if device == "cpu" else max(1, cores_per_rank - workers)
    if mode == "dp" and device == "cuda":
        threads = max(threads, 2)  # DataParallel's host work (scatter, replicate, gather) is per GPU
    if workers * nproc > cpus:
        notes.append(f"{workers} workers x {nproc} ranks exceed the {cpus} usable cores")

    # --- rendezvous --------------------------------------------------------------------------------------------
    port_req = dist.get("master_port", "auto")
    addr = str(dist.get("master_addr") or "127.0.0.1")
    if port_req != "auto":
        port = _as_int(port_req, "dist.master_port", problems, 1)
        if port is not None and port > 65535:
            problems.append(Problem(f"dist.master_port={port}: a TCP port is 1..65535"))
            port = None
    else:
        port = None
    on_slurm = (cfg.get("launcher") or {}).get("name") == "slurm"
    if on_slurm:
        # decided in the job (launcher/job.py): c10d on the allocation's first host, a port derived from the job id
        # (or dist.master_port); one node: localhost:0. Nothing on this login node to check.
        rendezvous = Rendezvous("slurm", "", port or 0)
    elif nnodes > 1:
        if addr in ("127.0.0.1", "localhost", "::1"):
            problems.append(
                Problem(
                    f"nnodes={nnodes} needs dist.master_addr set to node 0's address, reachable from every node "
                    "(it is 127.0.0.1)"
                )
            )
        if port is None:
            port = MULTI_NODE_DEFAULT_PORT
            notes.append(f"multi-node: dist.master_port=auto means {port} on every node")
        rendezvous = Rendezvous("static", addr, port)
    elif world_size == 1 and mode in ("single", "dp"):
        rendezvous = Rendezvous("none")
    elif port is None:
        rendezvous = Rendezvous("standalone", "localhost", 0)
    else:
        rendezvous = Rendezvous("static", addr, port)
    if port is not None and port_is_free is not None and node_rank == 0 and not on_slurm and not port_is_free(port):
        problems.append(
            Problem(
                f"dist.master_port={port} is already in use on this machine (another job?). "
                "Pick another port, or leave dist.master_port=auto on a single node",
                environment=True,
            )
        )

    # --- distributed toggles -----------------------------------------------------------------------------------
    nccl_debug = (dist.get("nccl") or {}).get("debug")
    if nccl_debug is not None and nccl_debug not in NCCL_DEBUG_LEVELS:
        problems.append(Problem(f"dist.nccl.debug={nccl_debug!r}: expected null or one of {', '.join(NCCL_DEBUG_LEVELS)}"))
    if str(dist.get("torch_debug", "OFF")) not in TORCH_DEBUG_LEVELS:
        problems.append(Problem(f"dist.torch_debug={dist.get('torch_debug')!r}: expected one of {', '.join(TORCH_DEBUG_LEVELS)}"))
    timeout_s = _as_int(dist.get("timeout_s"), "dist.timeout_s", problems, 1) or 600
    max_restarts = _as_int(dist.get("max_restarts", 0), "dist.max_restarts", problems, 0) or 0
    if dist.get("fallback", "none") not in FALLBACKS:
        problems.append(Problem(f"dist.fallback={dist.get('fallback')!r}: expected one of {', '.join(FALLBACKS)}"))
    if dist.get("sync_bn") and device == "cpu" and mode == "ddp":
        problems.append(Problem("dist.sync_bn=true needs GPUs (torch's SyncBatchNorm has no CPU kernel)"))

    single_node = nnodes == 1 and not on_slurm
    env = {**thread_environment(threads), **distributed_environment(dist, single_node), "PYTHONUNBUFFERED": "1"}

    plan = LaunchPlan(
        mode=mode,
        device=device,
        backend=backend,
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        gpus_per_node=gpus,
        devices_per_rank=devices_per_rank,
        world_size=world_size,
        batch_per_device=batch_per_device,
        batch_per_rank=batch_per_rank,
        global_batch=global_batch,
        base_lr=float(base_lr),
        base_batch=base_batch,
        lr_scaling=rule,
        lr0=lr0,
        warmup_epochs=warmup.epochs if warmup else None,
        warmup_iterations=warmup.iterations if warmup else None,
        warmup_images=warmup.images if warmup else None,
        batches_per_epoch=batches_per_epoch,
        train_images=train_images,
        workers_per_rank=workers,
        threads_per_rank=threads,
        cpus_per_node=cpus,
        rendezvous=rendezvous,
        max_restarts=max_restarts,
        timeout_s=timeout_s,
        env=env,
        notes=tuple(notes),
        cuda_graphs=uses_cuda_graphs(train, device=device, mode=mode),
    )
    return plan, problems


def _check_extra(extra: dict) -> list[Problem]:
    from launcher import ultralytics_files

    known = ultralytics_files.default_train_args()
    problems = []
    for key in extra:
        if key in OWNED_ULTRALYTICS_ARGS:
            problems.append(Problem(f"train.extra.{key}: ddp-launch sets this itself; use {OWNED_ULTRALYTICS_ARGS[key]}"))
        elif key not in known:
            problems.append(Problem(f"train.extra.{key}: not an Ultralytics train argument"))
    return problems


def uses_cuda_graphs(train: dict, *, device: str, mode: str) -> bool:
    """train.cuda_graphs resolved. `auto` replays the network's step as CUDA graphs wherever it can: a CUDA rank
    driving its own GPU (not DataParallel), the network not compiled (train.compile brings its own graphs). On an
    H200 the graphs took yolov8s from 750 to 1,307 images/s end to end (docs/benchmarks/README.md, section 3)."""
    value = train.get("cuda_graphs", "auto")
    if value == "auto":
        return device == "cuda" and mode != "dp" and train.get("compile", False) in (False, None)
    return value is True


def _check_step(train: dict, optim: dict, *, device: str, mode: str, hw: Hardware) -> list[Problem]:
    """The step's speed settings: train.compile, train.cuda_graphs, train.steps_in_flight, optim.fused."""
    problems = []
    if optim.get("fused", "auto") not in FUSED_VALUES:
        problems.append(Problem(f"optim.fused={optim.get('fused')!r}: expected auto, true or false"))
    in_flight = train.get("steps_in_flight", 1)
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 0:
        problems.append(Problem(f"train.steps_in_flight={in_flight!r}: expected a whole number >= 0 (0: the host waits "
                                "for the GPU at every step's end; 1: it queues the next step while the GPU runs this one)"))
    if train.get("cuda_graphs", "auto") not in GRAPHS_VALUES:
        problems.append(Problem(f"train.cuda_graphs={train.get('cuda_graphs')!r}: expected auto, true or false"))
    graphs = train.get("cuda_graphs", "auto") is True  # asked for explicitly; `auto` gives way (uses_cuda_graphs)
    if graphs and mode == "dp":
        problems.append(Problem("train.cuda_graphs=true is not supported with mode=dp; use mode=ddp"))
    value = train.get("compile", False)
    if value is False or value is None:
        return problems
    if value is not True and value not in COMPILE_MODES:
        problems.append(Problem(f"train.compile={value!r}: expected false, true or one of {', '.join(COMPILE_MODES)}"))
        return problems
    if graphs:
        problems.append(
            Problem("train.compile with train.cuda_graphs=true: choose one (train.compile=reduce-overhead compiles the "
                    "network and replays it as CUDA graphs)")
        )
    if mode == "dp":
        problems.append(Problem("train.compile is not supported with mode=dp (DataParallel re-replicates the network "
                                "every step); use mode=ddp"))
    if value in ("reduce-overhead", "max-autotune") and device != "cuda":
        problems.append(Problem(f"train.compile={value} replays CUDA graphs: it needs GPUs; on the CPU use train.compile=default"))
    if device == "cuda" and hw.gpu_count and not hw.triton_available:
        problems.append(
            Problem("train.compile on GPUs needs Triton, which this Python lacks: pip install triton, or train.compile=false",
                    environment=True)
        )
    return problems


def check_plan(problems: list[Problem], *, dry_run: bool) -> tuple[list[Problem], list[Problem]]:
    """Split problems into (errors, warnings). A dry run shows the plan despite problems about this machine."""
    if dry_run:
        return [p for p in problems if not p.environment], [p for p in problems if p.environment]
    return list(problems), []


def describe(plan: LaunchPlan, model: ModelSpec | None, data: DatasetInfo | None) -> str:
    """The plan as a user reads it: one fact per line."""
    rdzv = plan.rendezvous
    rdzv_text = {
        "standalone": "c10d standalone on localhost:0 (torchrun picks a free port; several jobs per node are fine)",
        "static": f"{rdzv.addr}:{rdzv.port}",
        "none": "none (one process)",
        "slurm": "decided in the job: c10d on the allocation's first host, port "
        + (str(rdzv.port) if rdzv.port else "20000 + job id mod 10000")
        + " (one node: localhost:0)",
    }[rdzv.kind]
    lines = [
        f"mode            {plan.mode}" + (f" ({plan.backend})" if plan.backend else ""),
        f"topology        {plan.nnodes} node(s) x {plan.nproc_per_node} rank(s) = world size {plan.world_size}"
        + (f", node_rank {plan.node_rank}" if plan.nnodes > 1 else ""),
        "device          "
        + (f"{plan.gpus_per_node} GPU(s) per node, cuda:LOCAL_RANK" if plan.device == "cuda" else "CPU"),
        f"batch           {plan.batch_per_device} per device x {plan.devices_per_rank * plan.world_size} device(s)"
        f" = global batch {plan.global_batch}",
        f"lr0             {plan.lr0:.6g} = base_lr {plan.base_lr:g} x {plan.lr_scaling}({plan.global_batch}/{plan.base_batch})",
    ]
    if plan.warmup_iterations is not None:
        lines.append(
            f"warmup          {plan.warmup_iterations} steps = {plan.warmup_images} images"
            f" ({plan.warmup_epochs:.3g} epochs of {plan.batches_per_epoch} steps per rank)"
        )
    else:
        lines.append("warmup          in epochs; steps are known once the dataset is counted")
    lines += [
        f"loader          {plan.workers_per_rank} worker(s) per rank, {plan.threads_per_rank} thread(s) per rank,"
        f" {plan.cpus_per_node} usable core(s)",
        f"rendezvous      {rdzv_text}",
        *([f"step            CUDA graphs {'on' if plan.cuda_graphs else 'off'} (train.cuda_graphs)"] if plan.device == "cuda" else []),
        f"restarts        {plan.max_restarts}; collective timeout {plan.timeout_s} s",
    ]
    if model is not None:
        lines.append(f"model           {model.cfg or ''}" + (f" from {model.weights}" if model.weights else ""))
    if data is not None:
        count = f"{data.train_images} train / {data.val_images} val images" if data.train_images else "size unknown"
        lines.append(f"data            {data.name}: {data.spec.get('path')} ({count}){' - ' + data.note if data.note else ''}")
    lines += [f"note            {n}" for n in plan.notes]
    return "\n".join(lines)
