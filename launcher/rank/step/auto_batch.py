"""`train.batch_per_device=auto`: the largest per-device batch whose step fits `train.memory_fraction` of the GPU.

Ultralytics' autobatch (its `batch=-1`) profiles a forward and backward pass at a few batch sizes, fits memory =
a + b x batch and solves for the fraction of the GPU's memory. Here the measured thing is the training step as the
run takes it (components.py builds it: the network with channels_last, AMP, the CUDA graphs captured for that batch,
the sync-free loss, the fused optimizer's step, the EMA), on synthetic batches of the real image size: every target
bucket the run will capture, captured as its set-up captures them (captured_step.buckets), and a step at the most
targets one image of the data can carry after mosaic (eager where no graph takes it); memory is the allocator's peak
reserved bytes (what it takes from the GPU, so what an out-of-memory error sees). The fit's answer is rounded down to
the allowed sizes (plan/batch.py, _auto_batch_rule: multiples of 8, dividing train.global_batch's share, at most an
eighth of a rank's share of the data) and then VERIFIED with real steps; a size that runs out of memory or over the
limit backs off to the next allowed size down.

The run itself is then HELD to the fraction plus plan.py's AUTO_BATCH_HEADROOM
(`torch.cuda.set_per_process_memory_fraction`): the caching allocator never frees what it has cached until an
allocation fails at the device's end, so without a bound the validation, the input pipeline and the allocator's
fragmentation grow what the run reserves to the whole GPU while its tensors hold half of it. Held, it frees its
cache at the bound instead (summary.json's memory_alloc_retries counts those), and the rest of the GPU stays free
as train.memory_fraction asked. So the chosen batch is SETTLED against that bound on the whole loop (`settle`): its
steps with a validation batch beside them (the validation's forward graph has a memory pool of its own, and an
untrained model's NMS its thousands of candidates), backing off while the peak is over the held bytes.

`choose` is the search, over any `measure(batch) -> peak bytes | None` (None: out of memory), so that it is tested
on the CPU with a fake memory model; `measure` and `CudaMemory` are the CUDA side. Each rank measures its own GPU
before the process group exists (the loss's normaliser would all-reduce, and ranks measure different sizes); `agree`
takes the smallest answer over the job from the ranks' gathered records.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from launcher.plan.batch import AUTO_BATCH_MIN_STEPS, held_fraction
from launcher.rank.data.pipeline import MAX_TARGETS, TARGETS_PER_IMAGE

PROFILE = (8, 16, 32, 64)  # the sizes fitted (those the rule allows), smallest first; stops at the first that fails
MAX_VERIFY = 8  # verified sizes below the fit's answer before settling for the largest profiled one that fitted
PROBE_TARGETS = 16  # targets per synthetic image where the data's most crowded image is not known to be fuller
STEPS = 2  # steps per measured size: the first allocates what the step keeps (workspaces, the loss's grid cache)
MiB, GiB = 2**20, 2**30


class NoBatchFits(RuntimeError):
    """Not even the smallest allowed batch fits the limit."""


@dataclass
class Choice:
    batch: int
    total: int  # bytes of the GPU
    limit: int  # bytes the step may take: fraction x total
    fixed: float | None  # the fit's a (bytes), None with fewer than two sizes fitted
    per_image: float | None  # the fit's b (bytes per image)
    measured: dict[int, int | None] = field(default_factory=dict)  # batch -> peak bytes, None: out of memory
    limited_by: str = "memory"  # memory | the training set | train.global_batch (the rule's `most`)
    whole: dict[int, int | None] = field(default_factory=dict)  # settle's: batch -> the whole loop's peak bytes
    held: int | None = None  # bytes the run is held to (settle's bound)

    def record(self, fraction: float, device: str) -> dict:
        """summary.json's auto_batch: the batch and why."""
        return {
            "batch_per_device": self.batch, "device": device, "fraction": fraction,
            "total_gib": round(self.total / GiB, 3), "limit_gib": round(self.limit / GiB, 3),
            "held_fraction": held_fraction(fraction), "held_gib": round(held_fraction(fraction) * self.total / GiB, 3),
            "memory_per_image_mib": None if self.per_image is None else round(self.per_image / MiB, 2),
            "fixed_mib": None if self.fixed is None else round(self.fixed / MiB, 1),
            "peak_gib": _gib(self.measured.get(self.batch)), "limited_by": self.limited_by,
            "candidates": [{"batch": b, "peak_gib": _gib(p), "fits": p is not None and p <= self.limit}
                           for b, p in self.measured.items()],
            "with_validation": [{"batch": b, "peak_gib": _gib(p), "fits": p is not None and p <= self.held}
                                for b, p in self.whole.items()],
        }


def _gib(value: int | None) -> float | None:
    return None if value is None else round(value / GiB, 3)


def _per_size(peaks) -> str:
    """(batch, peak GiB or None) pairs in words: '8: 2.0 GiB, 432: out of memory'."""
    return ", ".join(f"{b}: " + ("out of memory" if p is None else f"{p:.1f} GiB") for b, p in peaks)


def allowed(rule: dict) -> Callable[[int], bool]:
    """The batches the plan's rule allows: multiples of `multiple`, dividing `divides`, at most `most`."""
    multiple, divides, most = rule["multiple"], rule.get("divides"), rule.get("most")
    return lambda b: b >= multiple and b % multiple == 0 and (not divides or divides % b == 0) and (not most or b <= most)


def fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least squares memory = a + b x batch through (batch, bytes) points; (a, b)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def choose(measure: Callable[[int], int | None], *, total: int, rule: dict,
           profile: tuple[int, ...] = PROFILE) -> Choice:
    """The largest allowed batch whose measured peak is within rule['fraction'] x total."""
    limit = int(rule["fraction"] * total)
    ok, multiple, most = allowed(rule), rule["multiple"], rule.get("most")
    measured: dict[int, int | None] = {}

    def fits(b: int) -> bool:
        if b not in measured:
            measured[b] = measure(b)
        return measured[b] is not None and measured[b] <= limit

    sizes = [b for b in profile if ok(b)]
    if len(sizes) < 2:  # a rule few profile sizes meet (a global batch's share of 8 x an odd number): its own sizes
        sizes = sorted({*sizes, *[b for b in range(multiple, (most or profile[-1]) + 1, multiple) if ok(b)][:2]})
    sizes = sizes or [multiple]
    fitted, failed = [], None
    for b in sizes:
        if not fits(b):
            failed = b
            break
        fitted.append(b)
    if not fitted:
        peak = measured[sizes[0]]
        raise NoBatchFits(f"train.batch_per_device=auto: a batch of {sizes[0]} takes "
                          f"{'more than the GPU has' if peak is None else f'{peak / GiB:.1f} GiB'}, over the limit of "
                          f"{limit / GiB:.1f} GiB ({100 * rule['fraction']:g} % of {total / GiB:.1f} GiB); set "
                          "train.batch_per_device to a number, or a smaller train.imgsz or model, or a larger "
                          "train.memory_fraction")
    a = b_per = None
    top = fitted[-1]
    if len(fitted) >= 2:
        a, b_per = fit([(b, measured[b]) for b in fitted])
        predicted = (limit - a) / b_per if b_per > 0 else math.inf
        bound = min(x for x in (failed - 1 if failed else math.inf, most or math.inf, predicted))
        if math.isfinite(bound):
            candidates = [b for b in range(int(bound) // multiple * multiple, top, -multiple) if ok(b)]
            for b in candidates[:MAX_VERIFY]:  # from the fit's answer down: the first that really fits
                if fits(b):
                    top = b
                    break
    choice = Choice(top, total, limit, a, b_per, measured)
    if most and top == most:  # the rule's bound, not memory, stopped it
        choice.limited_by = "train.global_batch" if rule.get("divides") else "the training set"
    return choice


def settle(choice: Choice, measure_whole: Callable[[int], int | None], *, rule: dict) -> Choice:
    """`choice`'s batch, or the largest allowed one below it whose whole loop (`measure_whole(batch)`: steps and a
    validation batch) peaks within the bytes the run is held to; each step down skips as many sizes as the excess
    over the fit's memory per image says. At most MAX_VERIFY sizes; none fits: NoBatchFits."""
    held = int(held_fraction(rule["fraction"]) * choice.total)
    ok, multiple = allowed(rule), rule["multiple"]
    choice.held, b = held, choice.batch
    for _ in range(MAX_VERIFY):
        peak = choice.whole[b] = measure_whole(b)
        if peak is not None and peak <= held:
            if b < choice.batch:  # the validation's memory, not the rule's bound, decided
                choice.batch, choice.limited_by = b, "memory"
            return choice
        over = peak - held if peak is not None else choice.total - held  # out of memory: at least all above held
        fewer = max(multiple, math.ceil(over / choice.per_image / multiple) * multiple) if choice.per_image else multiple
        b = next((x for x in range(b - fewer, 0, -multiple) if ok(x)), 0)
        if not b:
            break
    raise NoBatchFits(f"train.batch_per_device=auto: with a validation batch beside its steps no batch from "
                      f"{choice.batch} down fits the {held / GiB:.1f} GiB the run is held to "
                      f"({100 * held_fraction(rule['fraction']):g} % of {choice.total / GiB:.1f} GiB; measured "
                      + _per_size((x, _gib(p)) for x, p in choice.whole.items()) + "); set train.batch_per_device to a number, a smaller val.batch, or a larger "
                      "train.memory_fraction")


def agree(records: list[dict]) -> dict:
    """Every rank's record (rank order) -> the job's: the smallest batch any GPU takes, with that rank's why."""
    smallest = min(records, key=lambda r: r["batch_per_device"])
    return {**smallest, "rank": records.index(smallest),
            "ranks": [r["batch_per_device"] for r in records] if len(records) > 1 else None}


def explain(record: dict) -> str:
    """Rank 0's line before the first step: the batch and why."""
    why = (f"{record['memory_per_image_mib']:.0f} MiB per image + {record['fixed_mib'] / 1024:.1f} GiB fixed"
           if record.get("memory_per_image_mib") is not None else "only the smallest size was measured")
    tried = _per_size((c["batch"], c["peak_gib"]) for c in record["candidates"])
    bound = {"memory": "", "the training set": f" (the most that leaves every epoch {AUTO_BATCH_MIN_STEPS} steps of the "
             "training set)"}.get(record["limited_by"], f" (as large as {record['limited_by']} allows)")
    ranks = f"; the smallest over ranks {record['ranks']}" if record.get("ranks") else ""
    whole = _per_size((c["batch"], c["peak_gib"]) for c in record.get("with_validation") or [])
    return (f"auto batch: {record['batch_per_device']} per device{bound}, the largest whose step fits "
            f"{100 * record['fraction']:g} % of {record['total_gib']:.1f} GiB = {record['limit_gib']:.1f} GiB on "
            f"{record['device']} ({why}; peak reserved per size {tried}){ranks}; the run's allocator held to "
            f"{100 * record['held_fraction']:g} % = {record['held_gib']:.1f} GiB"
            + (f" (with a validation batch beside the steps {whole})" if whole else ""))


# --- the CUDA side -------------------------------------------------------------------------------------------------
class CudaMemory:
    """The device's total and the caching allocator's peak reserved bytes since the last `release`."""

    def __init__(self, device: torch.device):
        self.device = device

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def release(self) -> None:
        """Everything freed given back to the device, and the peak counted from here."""
        gc.collect()  # graphs and autograd state in reference cycles
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device)

    def hold(self, fraction: float) -> None:
        """The caching allocator frees its cache and retries at `fraction` of the GPU instead of growing past it
        (an allocation that still does not fit is an out-of-memory error)."""
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)


def measure(run_at: Callable[[int], None], batch: int, memory) -> int | None:
    """Peak bytes of `run_at(batch)` (steps at that batch), None when it runs out of memory; freed afterwards."""
    memory.release()
    out_of_memory = False
    try:
        run_at(batch)
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True  # handled out here: the traceback's frames (and their tensors) are gone by release()
    peak = None if out_of_memory else memory.peak()
    memory.release()
    return peak


def synthetic_batch(batch: int, imgsz: int, device: torch.device, *, dtype: torch.dtype, channels_last: bool,
                    nc: int, targets: int = PROBE_TARGETS) -> dict:
    """A training batch as the input pipeline hands it to the step: images in the pipeline's dtype and layout, and
    `targets` boxes per image on a grid (batch_idx, cls, bboxes in normalised xywh, the host's counts)."""
    g = torch.Generator(device=device).manual_seed(0)
    img = torch.rand(batch, 3, imgsz, imgsz, generator=g, device=device).to(dtype)
    if channels_last:
        img = img.contiguous(memory_format=torch.channels_last)
    side = math.ceil(math.sqrt(targets))
    k = torch.arange(targets)
    box = torch.stack([(k % side + 0.5) / side, (k // side + 0.5) / side,
                       torch.full((targets,), 0.6 / side), torch.full((targets,), 0.6 / side)], 1)
    return {
        "img": img,
        "batch_idx": torch.arange(batch).repeat_interleave(targets).float().to(device),
        "cls": (torch.arange(batch * targets) % max(nc, 1)).float()[:, None].to(device),
        "bboxes": box.repeat(batch, 1).to(device),
        TARGETS_PER_IMAGE: [targets] * batch,
        MAX_TARGETS: targets,
        "im_file": [f"synthetic{i}" for i in range(batch)],
    }
