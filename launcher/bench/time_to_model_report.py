"""The report of `ddp-bench bench.kind=time_to_model` (time_to_model.py runs the sides): each side's means over the
seeds, the ratio of the wall clocks (Ultralytics / ddp-launch) and the verdict against the target (TARGET where
Ultralytics is input-bound; TASK_TARGETS at the same quality for segmentation and pose), each variant's wall clock
against the defaults' and Ultralytics' apart from the verdict; bench.json, bench.md and bench.png (a bar per run of
where its time went). The sides' quality is compared on the task's own metric (bench_tasks.quality: a segmentation
run's mask mAP50-95, a pose run's keypoints', the boxes' for detection and obb, a classifier's top-1 accuracy), with
the box mAP50-95 beside it where the task has boxes.
"""

from __future__ import annotations

import math
from pathlib import Path

from launcher.bench import report
from launcher.bench.bench_tasks import quality, trainer
from launcher.plan.task_rules import rules

SIDES = ("ultralytics", "ddp_launch")  # the verdict's two; variants add ddp_launch-NAME sides
PARTS = ("startup", "training", "validation", "boundaries", "end", "other")
TARGET = 2.0  # the project's aim: ddp-launch reaches the weights at least this much sooner ...
INPUT_BOUND = 0.15  # ... where Ultralytics' training waits for data at least this share of its step time
# segmentation and pose: at least this much sooner at the same quality, however fed Ultralytics' loader is
TASK_TARGETS = {"segment": 1.5, "pose": 1.5}
MAP_TOLERANCE = 0.01  # mAP50-95 within this of Ultralytics' (means over the seeds)


def side_names(variants: dict | None) -> list[str]:
    return [*SIDES, *(f"ddp_launch-{name}" for name in variants or {})]


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _quality(side: dict) -> float | None:
    """A side's quality: the task's own mAP50-95 (a side recorded without one: its box mAP50-95)."""
    return side["quality"] if side.get("quality") is not None else side.get("map50_95")


def own_metric(task: str) -> str | None:
    """The words of the metric the sides are compared on where it is not the box mAP50-95 (segment, pose: their own
    mAP50-95; classify: top-1 accuracy); None otherwise."""
    key, words = quality(task)
    return None if key == "map50_95" else words


def _diff(means: dict, key: str) -> float | None:
    """ddp-launch's mean of `key` minus Ultralytics' (None where a side failed or has none: a classifier's mAP)."""
    if not all(name in means and means[name][key] is not None for name in SIDES):
        return None
    return means["ddp_launch"][key] - means["ultralytics"][key]


def maps_text(side: dict, own: str | None, spec: str) -> str:
    """A side's box mAP50-95 (where it has one) and the task's own metric (`own`), as the report's lines give them."""
    box = [f"mAP50-95 {side['map50_95']:{spec}}"] if side.get("map50_95") is not None else []
    mine = side.get("quality")
    return ", ".join(box + ([f"{own} {mine:{spec}}"] if own and mine is not None else []))


def summarize(sides: list[dict], variants: dict | None = None, task: str = "detect") -> dict:
    """Means per side over the seeds, the ratio of the walls (Ultralytics / ddp-launch) and the verdict on the
    `task`'s own mAP50-95; each variant's mean wall clock against the defaults' and Ultralytics' (`variants`), apart
    from the verdict."""
    ran = [s for s in sides if "error" not in s]
    means = {}
    for name in side_names(variants):
        mine = [s for s in ran if s["name"] == name]
        if mine:
            means[name] = {
                "runs": len(mine),
                **{k: _mean([s.get(k) for s in mine]) for k in ("wall_s", "map50", "map50_95", "data_wait", "gpu_util")},
                "quality": _mean([_quality(s) for s in mine]),
                "breakdown": {p: _mean([s["breakdown"][p] for s in mine]) for p in PARTS},
            }
    per_seed = {}
    for seed in dict.fromkeys(s["seed"] for s in ran):
        walls = {s["name"]: s["wall_s"] for s in ran if s["seed"] == seed}
        if all(name in walls for name in SIDES):
            per_seed[str(seed)] = walls["ultralytics"] / walls["ddp_launch"]
    both = all(name in means for name in SIDES)
    ratio = means["ultralytics"]["wall_s"] / means["ddp_launch"]["wall_s"] if both else None
    map_diff, quality_diff = _diff(means, "map50_95"), _diff(means, "quality")
    compared = {}
    for name, overrides in (variants or {}).items():
        mine = means.get(f"ddp_launch-{name}")
        compared[name] = {"overrides": list(overrides), "wall_s": mine and mine["wall_s"],
                          "map50_95": mine and mine["map50_95"], "quality": mine and mine["quality"],
                          "vs_defaults": _ratio(means.get("ddp_launch"), mine),
                          "vs_ultralytics": _ratio(means.get("ultralytics"), mine)}
    return {"sides": sides, "means": means, "ratio": ratio, "ratio_per_seed": per_seed, "map50_95_diff": map_diff,
            "quality_diff": quality_diff, "task": task, "verdict": verdict(means, ratio, map_diff, quality_diff, task),
            "variants": compared}


def _ratio(slower: dict | None, faster: dict | None) -> float | None:
    """`slower`'s mean wall clock over `faster`'s: above 1 where `faster` reached the weights sooner."""
    return slower["wall_s"] / faster["wall_s"] if slower and faster else None


def verdict(means: dict, ratio: float | None, map_diff: float | None, quality_diff: float | None = None,
            task: str = "detect") -> dict:
    """The ratio against the target, where Ultralytics is input-bound, with the same quality: the task's own metric
    (`quality_diff`, ddp-launch's minus Ultralytics': a mask or pose mAP50-95, a classifier's top-1 accuracy; the box
    mAP50-95's `map_diff` where None) within MAP_TOLERANCE, the box one beside it where the task has boxes."""
    target = target_of(task)
    if ratio is None:
        return {"target": target, "met": None, "input_bound": None, "text": "incomplete: a side failed (see its log)"}
    wait = means["ultralytics"]["data_wait"]
    input_bound = None if wait is None else wait >= INPUT_BOUND
    own = own_metric(task)
    judged = quality_diff if own and quality_diff is not None else map_diff
    same_map = abs(judged) <= MAP_TOLERANCE
    words = quality(task)[1]  # obb's: the rotated boxes'
    maps = f"{words} {judged:+.4f} ({'within' if same_map else 'outside'} {MAP_TOLERANCE})" + (
        f", box mAP50-95 {map_diff:+.4f}" if own and map_diff is not None else "")
    d = means["ddp_launch"]["breakdown"]
    bound = max((p for p in PARTS if p != "other"), key=lambda p: d[p])
    head = f"ddp-launch reached the weights {ratio:.2f}x sooner (Ultralytics {means['ultralytics']['wall_s']:.1f} s, " \
           f"ddp-launch {means['ddp_launch']['wall_s']:.1f} s); {maps}"
    if task in TASK_TARGETS:
        met = ratio >= target and same_map
        where = f"the {target:.1f}x target at the same {words} is {'met' if met else 'missed'}"
    elif input_bound is None:
        where = "Ultralytics' data wait was not measured (the run was shorter than the meter's warm-up)"
        met = None
    elif input_bound:
        met = ratio >= TARGET and same_map
        where = f"Ultralytics input-bound ({100 * wait:.0f} % data wait): the {TARGET:.1f}x target is " \
                f"{'met' if met else 'missed'}"
    else:
        met = None
        where = f"Ultralytics' loader kept up ({100 * wait:.0f} % data wait, under {100 * INPUT_BOUND:.0f} %): " \
                f"the {TARGET:.1f}x target applies to input-bound runs; the ratio and both breakdowns are reported"
    text = f"{head}. {where}"
    if met is not True:
        text += f". ddp-launch's largest part: {bound} {d[bound]:.1f} s ({100 * d[bound] / means['ddp_launch']['wall_s']:.0f} %)"
    return {"target": target, "met": met, "input_bound": input_bound, "same_map": same_map, "text": text}


def target_of(task: str) -> float:
    """The ratio the verdict asks of `task`'s race: TASK_TARGETS' at the same quality, else TARGET where Ultralytics
    is input-bound."""
    return TASK_TARGETS.get(task, TARGET)


def target_text(task: str) -> str:
    """The report's line on the target, after the ratio."""
    if task in TASK_TARGETS:
        return f"target {target_of(task):.1f}x at the same {quality(task)[1]}."
    return f"target {TARGET:.1f}x where Ultralytics is input-bound (data wait >= {100 * INPUT_BOUND:.0f} %)."


def _fmt(v, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * scale:{spec}}{suffix}"


def markdown(out: dict) -> str:
    st = out["settings"]
    task = out.get("task") or st.get("task") or "detect"
    own = own_metric(task)  # a column of its own beside the box mAP50-95 (segment, pose, classify)
    beside = ", the box one beside it." if own and rules(task).boxes else "."  # a classifier has no box mAP
    lines = [
        "# ddp-bench: time to a trained model",
        "",
        f"Command: `{out['command']}`",
        "",
        *(f"With the sides of seeds {e['seeds']} from an earlier invocation on this machine: `{e['command']}` "
          f"({e['path']})" for e in out.get("earlier") or []),
        *([""] if out.get("earlier") else []),
        f"{st['model']}, {st['data']['train_images']} train / {st['data']['val_images']} val images "
        f"({_fmt(st['data']['mean_train_file_kb'], '.0f', suffix=' kB')} per train file), {st['imgsz']} px, "
        f"{st['epochs']} epochs, batch {st['batch']}, SGD lr0 {st['lr0']}"
        + (f", close_mosaic {st['close_mosaic']}" if rules(task).mosaic else "")  # a classifier has no mosaic
        + f", validation after every epoch, {st['device']}; seeds {st['seeds']}."
        + ("" if task == "detect" else f" Task {task}: Ultralytics' side runs its {trainer(task)}, and the sides "
           f"are compared on the {quality(task)[1]}{beside}"),
        "",
        "| side | seed | wall s | startup | training | validation | boundaries | end | other | mAP50 | mAP50-95 | "
        + (f"{own} | " if own else "") + "data wait | after the weights |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        + (" ---: |" if own else ""),
    ]
    for s in sorted(out["sides"], key=lambda s: (s["name"], s["seed"])):
        if "error" in s:
            lines.append(f"| {s['name']} | {s['seed']} | failed: {s['error']} |" + " |" * (11 if own else 10))
            continue
        b, a = s["breakdown"], s["after_weights"]
        lines.append("| " + " | ".join([s["name"], str(s["seed"]), _fmt(s["wall_s"], ".1f"),
                                        *(_fmt(b[p], ".1f") for p in PARTS), _fmt(s["map50"], ".4f"),
                                        _fmt(s["map50_95"], ".4f"), *([_fmt(_quality(s), ".4f")] if own else []),
                                        _fmt(s["data_wait"], ".1f", 100, " %"),
                                        _fmt(a["plots_s"] + a["exit_s"], ".1f")]) + " |")
    for name, m in out["means"].items():
        b = m["breakdown"]
        lines.append("| " + " | ".join([f"**{name} mean**", f"{m['runs']} run(s)", _fmt(m["wall_s"], ".1f"),
                                        *(_fmt(b[p], ".1f") for p in PARTS), _fmt(m["map50"], ".4f"),
                                        _fmt(m["map50_95"], ".4f"), *([_fmt(m["quality"], ".4f")] if own else []),
                                        _fmt(m["data_wait"], ".1f", 100, " %"), ""]) + " |")
    per_seed = ", ".join(f"seed {k}: {v:.2f}x" for k, v in out["ratio_per_seed"].items())
    lines += [
        "",
        f"Ratio (Ultralytics wall / ddp-launch wall, means): **{_fmt(out['ratio'], '.2f', suffix='x')}**"
        + (f" ({per_seed})" if per_seed else "") + f"; {target_text(task)}",
        "",
        f"Verdict: {out['verdict']['text']}.",
        "",
        *_variant_lines(out.get("variants") or {}, own),
        "Seconds. The wall clock runs from the side's command to its final weights on disk with the final validation "
        "done; startup: to the first training step; training: the epochs' steps (the first epoch from its first step); "
        "validation: after each epoch; boundaries: the rest between epochs (checkpoints, the loader between epochs); "
        "end: the last epoch's end to the weights (final validation, stripping); other: what the stamps leave "
        "unattributed. After the weights: Ultralytics' plots and each process's exit, not in the wall clock. Data wait: "
        "the share of step time the training loop waited for its batch (10 warm-up steps left out).",
        "",
        "Start-up, first seed:",
    ]
    for s in out["sides"]:
        if "error" not in s and s["seed"] == st["seeds"][0]:
            lines.append(f"- {s['name']}: " + "; ".join(f"{p['what']} {p['s']:.1f} s" for p in s["startup_parts"])
                         + f"; end: final validation {s['end_parts']['final_validation']:.1f} s, the rest "
                           f"{s['end_parts']['checkpoints']:.1f} s; boundaries: checkpoint writes "
                           f"{s['boundary_parts']['checkpoints']:.1f} s, the rest {s['boundary_parts']['other']:.1f} s")
            if s.get("setup_parts"):
                lines.append(f"  - {s['name']}'s rank set-up: " + ", ".join(
                    f"{p['part'].replace('_', ' ')} {p['s']:.1f} s" for p in s["setup_parts"]))
    if any(s.get("plots") is False for s in out["sides"]):
        lines += ["", "Note: polars is not installed: Ultralytics' plots were off (plots=False), ddp-launch left out "
                      "labels.jpg and results.png."]
    env = out["environment"]
    lines += ["", f"Environment: {', '.join(env['gpus']) or 'no GPU'}; driver {env.get('driver')}; torch {env['torch']} "
                  f"(CUDA {env.get('cuda')}); ultralytics {env.get('ultralytics')}; {env['cpu_count']} CPU cores; "
                  f"Python {env['python']}."]
    return "\n".join(lines) + "\n"


def _variant_lines(variants: dict, own: str | None = None) -> list[str]:
    if not variants:
        return []
    lines = ["Variants (ddp-launch's command with these overrides, in the same invocation; not in the verdict):"]
    for name, v in variants.items():
        lines.append(f"- ddp_launch-{name} (`{' '.join(v['overrides'])}`): " + (
            "failed" if v["wall_s"] is None else
            f"{v['wall_s']:.1f} s, {maps_text(v, own, '.4f')}; the defaults' wall clock / its: "
            f"{_fmt(v['vs_defaults'], '.3f', suffix='x')}, Ultralytics' / its: "
            f"{_fmt(v['vs_ultralytics'], '.2f', suffix='x')}"))
    return lines + [""]


COLOURS = {"startup": "#8c8c8c", "training": "#1f77b4", "validation": "#ff7f0e", "boundaries": "#9467bd",
           "end": "#d62728", "other": "#e0e0e0"}


def plot(out: dict, path: Path) -> None:
    """A stacked horizontal bar per side and seed: where its wall clock went."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = sorted((s for s in out["sides"] if "error" not in s), key=lambda s: (s["name"], s["seed"]))
    own = own_metric(out.get("task") or "detect")
    fig, ax = plt.subplots(figsize=(10, 2.2 + 0.5 * max(len(ran), 1)))
    for y, s in enumerate(ran):
        left = 0.0
        for part in PARTS:
            width = max(s["breakdown"][part], 0.0)
            ax.barh(y, width, left=left, color=COLOURS[part], label=part if y == 0 else None)
            left += width
        ax.text(left, y, f" {s['wall_s']:.1f} s, {maps_text(s, own, '.3f')}", va="center", fontsize=8)
    ax.set_yticks(range(len(ran)), [f"{s['name']} seed {s['seed']}" for s in ran])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the command to the final weights")
    ax.set_xlim(0, 1.3 * max((s["wall_s"] for s in ran), default=1.0))
    ratio = out.get("ratio")
    fig.suptitle("time to a trained model" + (f": Ultralytics / ddp-launch = {ratio:.2f}x" if ratio else ""))
    fig.legend(*ax.get_legend_handles_labels(), ncol=len(PARTS), fontsize=8, loc="upper center",
               bbox_to_anchor=(0.5, 0.93))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.84))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(out: dict, folder: Path) -> None:
    report.write(out, folder, as_markdown=markdown, as_plot=plot)
