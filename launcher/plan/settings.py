"""The ranks' settings: one typed dataclass per config group, made once from the resolved config (`Settings.of`),
with the defaults in one place (equal to conf/config.yaml's and conf/bench/default.yaml's: tests/test_settings.py).
A rank reads these, never the raw config dicts; what follows from several settings is decided in LaunchPlan."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def _of(cls, group: dict | None):
    """`cls` from a config group: its keys that are fields (the plan refused unknown ones), the rest defaulted."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in (group or {}).items() if k in names})


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 100
    imgsz: int = 640
    batch: int | float | None = None
    batch_per_device: int | str = 16
    memory_fraction: float = 0.6
    accumulate: int = 1
    global_batch: int | None = None
    amp: bool | str = True
    val_interval: int = 1
    cache: bool | str = False
    close_mosaic: int = 10
    patience: int = 100
    save_period: int = -1
    plots: bool = True
    cuda_graphs: bool | str = "auto"
    fused_bn_act: bool | str = "auto"
    cudnn_benchmark: bool = False
    cuda_connections: int | None = 32
    graph_scope: str = "auto"
    sync_free_loss: bool = True
    steps_in_flight: int = 1
    compile: bool | str = False
    extra: dict = field(default_factory=dict)  # Ultralytics' own train arguments, passed through


@dataclass(frozen=True)
class ValSettings:
    engine: str = "auto"
    batch: int | str = "auto"
    cuda_graphs: bool | str = "auto"
    fold_batchnorm: bool = False


@dataclass(frozen=True)
class OptimSettings:
    name: str = "sgd"
    base_lr: float = 0.01
    base_batch: int = 64
    lr_scaling: str = "linear"
    lr0_cap: float | None = None
    warmup_epochs: float = 3.0
    warmup_images: int | None = None
    warmup_bias_lr: float = 0.1
    warmup_momentum: float = 0.8
    momentum: float = 0.937
    weight_decay: float = 0.0005
    lrf: float = 0.01
    cos_lr: bool = False
    grad_clip: float = 10.0
    fused: bool | str = "auto"


@dataclass(frozen=True)
class LoaderSettings:
    workers: int | str = "auto"
    fetch_ahead: bool = True
    bind_cores: bool = True
    pin_memory: bool = True
    prefetch_factor: int = 4
    persistent_workers: bool = True
    mosaic_buffer: bool = True
    augment_on: str = "auto"


@dataclass(frozen=True)
class NcclSettings:
    """dist.nccl: the launcher turns these into the ranks' NCCL environment (plan/environment.py)."""
    debug: str | None = None
    debug_subsys: str | None = None
    p2p_disable: bool = False
    ib_disable: bool = False
    socket_ifname: str | None = None
    async_error_handling: bool = True


@dataclass(frozen=True)
class DistSettings:
    backend: str = "auto"
    master_addr: str = "127.0.0.1"
    master_port: int | str = "auto"
    timeout_s: int = 600
    max_restarts: int = 0
    fallback: str = "none"
    sync_bn: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = False
    debug: bool = False
    torch_debug: str = "OFF"
    nccl: NcclSettings = field(default_factory=NcclSettings)


@dataclass(frozen=True)
class LogSettings:
    interval_steps: int = 20
    verbose: bool = False
    integrations: list = field(default_factory=list)


@dataclass(frozen=True)
class DebugSettings:
    record_samples: bool = False


@dataclass(frozen=True)
class ModelSettings:
    """The chosen conf/model/ file's cfg and weights (each has its own), and the root config's switches."""
    name: str = ""
    cfg: str | None = None
    weights: str | None = None
    pretrained: bool = False
    allow_download: bool = False


@dataclass(frozen=True)
class DataSettings:
    name: str = ""
    path: str | None = None  # the data YAML the launcher wrote into the run folder


@dataclass(frozen=True)
class PathsSettings:
    cache: str = ""  # from the environment (conf/config.yaml): always present in a resolved config
    bytecode: str | None = "auto"


@dataclass(frozen=True)
class BenchSettings:
    """A ddp-bench cell's settings (conf/bench/default.yaml); absent from a training run."""
    warmup_steps: int = 20
    steps: int = 100
    ceiling_batches: int = 8
    baseline_workers: int = 8
    profile: bool = False
    cell: str | None = None


@dataclass(frozen=True)
class Settings:
    train: TrainSettings
    val: ValSettings
    optim: OptimSettings
    loader: LoaderSettings
    dist: DistSettings
    log: LogSettings
    debug: DebugSettings
    model: ModelSettings
    data: DataSettings
    paths: PathsSettings
    bench: BenchSettings | None = None
    seed: int = 0
    gpus: int | str = "auto"

    @classmethod
    def of(cls, cfg: dict) -> Settings:
        """The settings of a resolved config (RunFolder.load's)."""
        dist = cfg.get("dist") or {}
        return cls(train=_of(TrainSettings, cfg.get("train")), val=_of(ValSettings, cfg.get("val")),
                   optim=_of(OptimSettings, cfg.get("optim")), loader=_of(LoaderSettings, cfg.get("loader")),
                   dist=_of(DistSettings, {**dist, "nccl": _of(NcclSettings, dist.get("nccl"))}),
                   log=_of(LogSettings, cfg.get("log")), debug=_of(DebugSettings, cfg.get("debug")),
                   model=_of(ModelSettings, cfg.get("model")), data=_of(DataSettings, cfg.get("data")),
                   paths=_of(PathsSettings, cfg.get("paths")),
                   bench=_of(BenchSettings, cfg["bench"]) if cfg.get("bench") else None,
                   **{k: cfg[k] for k in ("seed", "gpus") if k in cfg})
