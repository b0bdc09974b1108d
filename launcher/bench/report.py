"""ddp-bench's report: per-cell figures from the ranks, a verdict in words, and bench.json / bench.md / bench.png."""

from __future__ import annotations

import hashlib
import json
import math
import platform
from pathlib import Path

from launcher.machine.hardware import detect
from launcher.plan.describe import THREAD_WORDS, input_bound_advice, input_thread_bound
from launcher.plan.keys import conf_dir

INPUT_BOUND = 0.10  # data wait above this share of step time: starved
PIPELINE_OK = 0.90  # end-to-end at or above this share of the data-free ceiling: the pipeline keeps up
GPU_BUSY = 85.0  # percent: below this with data ready, the step itself is host- or launch-bound
THREAD_SATURATED = 0.90  # an input thread working this share of the step per batch paces the loop
SCALING_OK = 0.90  # efficiency below this at size > 1: communication or a straggler


def aggregate(mode: str, size: int, ranks: list[dict]) -> dict:
    """One cell's figures from its ranks' reports: rates add up, the worst rank sets data wait."""
    gpus = [g for r in ranks for g in (r.get("gpus") or [])]
    ceilings = [r.get("ceiling_images_per_s") for r in ranks]
    ips = sum(r["images_per_s"] for r in ranks)
    ceiling = sum(ceilings) if all(c is not None for c in ceilings) and ceilings else None
    return {
        "mode": mode,
        "size": size,
        "images_per_s": ips,
        "data_wait": max(r["data_wait"] for r in ranks),
        "host_wait": max((r["host_wait"] for r in ranks if r.get("host_wait") is not None), default=None),
        "input_gpu_ms_per_image": _mean([r.get("input_gpu_ms_per_image") for r in ranks]),
        "input_threads": _threads([r.get("input_threads") for r in ranks]),
        "gpu_util": sum(g["util_mean"] for g in gpus) / len(gpus) if gpus else None,
        "gpu_util_per_gpu": [round(g["util_mean"], 1) for g in gpus],
        "memory_peak_gib": max((g["memory_peak_gib"] for g in gpus), default=None),
        "ceiling_images_per_s": ceiling,
        "ceiling_labels": ranks[0].get("ceiling_labels"),  # what the ceiling's batches carry: the task's targets
        "pipeline_efficiency": ips / ceiling if ceiling else None,
        "host_cpu": sum(r.get("host_cpu", 0.0) for r in ranks) / len(ranks),
        "step_ms": sum(r["step_ms"] for r in ranks) / len(ranks),
        "steps_measured": min(r["steps_measured"] for r in ranks),
        "whole_step_graph": all(r.get("whole_step_graph", False) for r in ranks),
        "loss_finite": all(math.isfinite(v) for r in ranks for v in (r.get("loss") or {}).values()),
    }


def _threads(per_rank: list[dict | None]) -> dict | None:
    """The input threads' figures per batch (rank/run/hooks.py InputTime), each the mean over the ranks that have it."""
    names = dict.fromkeys(name for t in per_rank if t for name in t)
    return {name: {key: _mean([t[name].get(key) for t in per_rank if t and name in t])
                   for key in ("waiting_ms", "working_ms", "blocked_ms", "busy")} for name in names} or None


def add_speedups(cells: list[dict]) -> None:
    """speedup against size 1 of the same mode, efficiency = speedup / size; ratio to Ultralytics at size 1."""
    ran = [c for c in cells if not c.get("skip") and not c.get("error")]
    base = {(c["mode"], c.get("variant", "")): c["images_per_s"] for c in ran if c["size"] == 1}
    ultralytics = base.get(("ultralytics", ""))
    for c in cells:
        if c not in ran:
            c.update(speedup=None, efficiency=None, vs_ultralytics=None)
            continue
        one = base.get((c["mode"], c.get("variant", "")))
        c["speedup"] = c["images_per_s"] / one if one else None
        c["efficiency"] = c["speedup"] / c["size"] if c["speedup"] is not None else None
        c["vs_ultralytics"] = c["images_per_s"] / ultralytics if ultralytics else None


def verdict(c: dict) -> str:
    """Where the time goes, in words, with the knob to turn."""
    if c.get("skip"):
        return f"skipped: {c['skip']}"
    if c.get("error"):
        return f"failed: {c['error']}"
    if c.get("loss_finite") is False:
        return "invalid: the loss is not finite (NaN or inf), so these figures are not a training run's"
    wait, util, pipe, eff = c["data_wait"], c.get("gpu_util"), c.get("pipeline_efficiency"), c.get("efficiency")
    busy = f"GPU {util:.0f} % busy, " if util is not None else ""
    if wait > INPUT_BOUND:
        return (
            f"input-bound: {busy}{100 * wait:.0f} % of step time waiting for data; "
            + (input_thread_bound(c.get("input_threads"), c.get("step_ms"))
               or input_bound_advice(c.get("input_gpu_ms_per_image") is not None))
        )
    if pipe is not None and pipe < PIPELINE_OK:
        paced = input_thread_bound(c.get("input_threads"), c.get("step_ms"), saturated=THREAD_SATURATED)
        if paced:  # the thread hands over a batch no sooner than the step takes one: the GPU idles between steps
            return f"input-paced: {100 * pipe:.0f} % of the data-free ceiling with {100 * wait:.0f} % data wait; {paced}"
        return (
            f"host-bound: {100 * pipe:.0f} % of the data-free ceiling with {100 * wait:.0f} % data wait; the loader "
            f"competes with the training process for the CPU (fewer loader.workers, or more cores per GPU)"
        )
    unread = _unread_utilisation(util, pipe, bool(c.get("whole_step_graph")))
    if unread:
        busy = ""
    elif util is not None and util < GPU_BUSY:
        return (
            f"step-bound: {busy}data ready ({100 * wait:.0f} % wait); the step itself is bound by per-step host work "
            f"and kernel launches: a larger train.batch_per_device or a compiled step would fill the GPU"
        )
    if c["size"] > 1 and eff is not None and eff < SCALING_OK:
        return (f"scaling-bound: {100 * eff:.0f} % efficiency at {c['size']} devices: communication or a straggler rank"
                + (f"; {unread}" if unread else ""))
    if util is None:
        return f"compute-bound on the CPU: {100 * wait:.0f} % data wait; the ranks are busy computing"
    return (f"fed: {busy}{100 * wait:.0f} % data wait, {100 * (pipe or 0):.0f} % of the data-free ceiling"
            + (f"; {unread}" if unread else ""))


def _unread_utilisation(util: float | None, pipe: float | None, whole_step_graph: bool = False) -> str:
    """Why NVML's utilisation cannot carry a verdict ("" when it can): a reading of 0 on a cell that trained (some
    drivers and cards report nothing: a GPU that ran the steps was busy some of the time), or a low reading on a step
    replayed as one CUDA graph at the pace of its data-free ceiling (such a step has no per-step host work or launches
    to be bound by: the card's NVML under-reports)."""
    if util is None or util >= GPU_BUSY:
        return ""
    at = f" at {100 * pipe:.0f} % of the data-free ceiling" if pipe is not None else ""
    if util <= 0:
        return f"GPU utilisation unavailable (NVML read 0 %{at}), so no verdict rests on it"
    if whole_step_graph and pipe is not None and pipe >= PIPELINE_OK:
        return (f"NVML's {util:.0f} % GPU utilisation is not trusted: the step replays as one CUDA graph{at}, with "
                "no per-step host work or launches to be bound by, so no verdict rests on it")
    return ""


def environment() -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "cpu_count": len(__import__("os").sched_getaffinity(0)),
        "cpu": platform.processor() or platform.machine(),
        "host": platform.node(),  # which machine: time_to_model reports runs together only from one (bench.earlier)
        "code": code_digest(),  # which ddp-launch: the same, for the same reason
        "gpus": [],
        "driver": None,
    }
    hw = detect()
    env["ultralytics"] = hw.ultralytics_version
    env["gpus"] = [g.name for g in hw.gpus]
    env["driver"] = hw.driver or None
    return env


def code_digest() -> str:
    """A digest of ddp-launch's own sources and shipped configs (the package as installed or checked out), so that
    two reports can tell whether they measured the same build: SHA-256 of every .py and .yaml file's path and bytes."""
    h = hashlib.sha256()
    for root in (Path(__file__).resolve().parents[1], Path(conf_dir())):  # conf/ is beside the package in a checkout
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts):
            h.update(f"{root.name}/{path.relative_to(root)}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _fmt(v, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if v is None else f"{v * scale:{spec}}{suffix}"


def _profiled(settings: dict) -> str:
    """The footnote's words for the steps bench.profile leaves out of the window (rank/run/runs.py, bench_cell)."""
    return " (on GPUs also the profiled steps after them: bench.profile)" if settings.get("profile") else ""


def _stamps(in_flight: int) -> str:
    """How the meter stamped step ends (meter.py), as the report's footnote says it."""
    if not in_flight:
        return "with CUDA-synchronised stamps"
    return (f"with CUDA-event stamps ({in_flight} step(s) in flight: the window is the GPU's time between step ends, "
            "and the host may queue that many steps ahead)")


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _task_lines(report: dict) -> list[str]:
    """The task the cells trained and what their ceiling's batches held (none for a report without a task)."""
    task = report.get("task")
    if not task:
        return []
    held = next((c["ceiling_labels"] for c in report["cells"] if c.get("ceiling_labels")), None)
    return [f"Task: {task}; each cell times its training step (its loss on its own batches)"
            + (f", and the data-free ceiling's batches hold its {', '.join(held)}" if held else "") + ".", ""]


def markdown(report: dict) -> str:
    lines = [
        "# ddp-bench",
        "",
        f"Command: `{report['command']}`",
        "",
        *_task_lines(report),
        "| cell | images/s | speedup | efficiency | vs Ultralytics | GPU busy | data wait | input GPU ms/img | ceiling images/s | of ceiling | peak GPU mem | host CPU | spread | verdict |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in report["cells"]:
        label = f"{c['mode']} x{c['size']}" + (f" {c['variant']}" if c.get("variant") else "")
        if c.get("skip") or c.get("error"):
            lines.append(f"| {label} | - | - | - | - | - | - | - | - | - | - | - | - | {c['verdict']} |")
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    label,
                    _fmt(c["images_per_s"], ".1f"),
                    _fmt(c["speedup"], ".2f", suffix="x"),
                    _fmt(c["efficiency"], ".0f", 100, " %"),
                    _fmt(c["vs_ultralytics"], ".2f", suffix="x"),
                    _fmt(c["gpu_util"], ".0f", suffix=" %"),
                    _fmt(c["data_wait"], ".1f", 100, " %"),
                    _fmt(c.get("input_gpu_ms_per_image"), ".3f"),
                    _fmt(c["ceiling_images_per_s"], ".1f"),
                    _fmt(c["pipeline_efficiency"], ".0f", 100, " %"),
                    _fmt(c["memory_peak_gib"], ".1f", suffix=" GiB"),
                    _fmt(c["host_cpu"], ".0f", 100, " %"),
                    _fmt(c.get("spread"), ".0f", 100, f" % of {len(c.get('repeats') or [])}"),
                    c["verdict"],
                ]
            )
            + " |"
        )
    env = report["environment"]
    lines += [
        "",
        "Speedup is against size 1 of the same mode; efficiency = speedup / size. Steady state: "
        f"{report['settings']['warmup_steps']} warm-up steps dropped{_profiled(report['settings'])}, "
        f"{report['settings']['steps']} steps measured "
        f"{_stamps(report['settings'].get('steps_in_flight', 0))}; GPU busy is NVML utilisation over the measured window; data wait is the host's wait for its batches counted only while the GPU had no step left to run (its wait in all is bench.json's host_wait: a host queueing steps ahead waits for data while the GPU works); input GPU ms/img (loader.augment_on=gpu) is the time elapsed on the stream that prepares a batch, from its decode to its augmented images, per image: it includes waits behind the step's kernels and for the preparing thread, so it bounds the input's GPU cost from above (- for the CPU input); the data-free ceiling is the "
        "same trainer step on real batches held on the device.",
        "",
        f"Environment: {', '.join(env['gpus']) or 'no GPU'}; driver {env.get('driver')}; torch {env['torch']} "
        f"(CUDA {env.get('cuda')}, NCCL {env.get('nccl')}); ultralytics {env.get('ultralytics')}; "
        f"{env['cpu_count']} CPU cores; Python {env['python']}.",
    ]
    host = report.get("host")
    if host:
        lines += ["", f"Host load (1-minute average): {host['load_before']:g} before the first cell, "
                      f"{host['load_after']:g} after the last, on {host['cores']} cores. Spread: (max - min) / max "
                      "of each cell's repeats (bench.repeats), the fastest run reported."]
    flagged = [c for c in report["cells"] if c.get("flags")]
    if flagged:
        from launcher.bench.trust import warnings

        lines += ["", "Not to be trusted as they stand:"] + [f"- {line}" for line in warnings(flagged)]
    threaded = [c for c in report["cells"] if c.get("input_threads")]
    if threaded:
        lines += ["", "The GPU input's threads, ms per batch over the measured steps (waiting for their input, working, "
                      "blocked with a batch ready: ahead of the step), and the step's ms:"]
        for c in threaded:
            label = f"{c['mode']} x{c['size']}" + (f" {c['variant']}" if c.get("variant") else "")
            lines.append(f"- {label} (step {_fmt(c.get('step_ms'), '.1f')}): " + "; ".join(
                f"{THREAD_WORDS.get(name, name)} {_fmt(t['waiting_ms'], '.1f')} / {_fmt(t['working_ms'], '.1f')} / "
                f"{_fmt(t['blocked_ms'], '.1f')}" for name, t in c["input_threads"].items()))
    variants = (report["settings"].get("variants") or {})
    if variants:
        lines += ["", "Variants (config overrides of each cell; a cell without a variant's name has the defaults):"]
        lines += [f"- {name or 'base'}: {' '.join(ov) if ov else '(none)'}" for name, ov in variants.items()]
    if report.get("notes"):
        lines += ["", "Notes:"] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ran = [c for c in report["cells"] if not c.get("skip") and not c.get("error") and c.get("speedup") is not None]
    sizes = sorted({c["size"] for c in ran}) or [1]
    ax1.plot(sizes, sizes, "k--", label="ideal")
    for key in dict.fromkeys((c["mode"], c.get("variant", "")) for c in ran):
        pts = sorted((c["size"], c["speedup"], c["efficiency"]) for c in ran if (c["mode"], c.get("variant", "")) == key)
        label = " ".join(filter(None, key))
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax2.plot([p[0] for p in pts], [100 * p[2] for p in pts], "o-", label=label)
    ax1.set(xlabel="devices", ylabel="speedup vs 1 device", title="speedup", xticks=sizes)
    ax2.set(xlabel="devices", ylabel="scaling efficiency (%)", title="efficiency", xticks=sizes, ylim=(0, 110))
    ax2.axhline(100, color="k", ls="--", lw=0.8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(report: dict, folder: Path, as_markdown=markdown, as_plot=plot) -> None:
    """bench.json, bench.md and bench.png (the time_to_model report passes its own table and picture)."""
    (folder / "bench.json").write_text(json.dumps(report, indent=2))
    (folder / "bench.md").write_text(as_markdown(report))
    as_plot(report, folder / "bench.png")
