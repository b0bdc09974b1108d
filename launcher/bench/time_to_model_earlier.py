"""`bench.earlier`: the sides of earlier `bench.kind=time_to_model` invocations reported with this one's.

One invocation of both sides over two seeds can outlast what a job (or a lent machine's command) may run; so the
seeds can be run one invocation each, back to back on one machine, the later invocations naming the earlier ones'
run folders. Their report then holds every side, with the means and the verdict over all the seeds.

Only what was measured the same way is put together, and this is checked before any side runs: the same settings
(model, data, image size, epochs, batch, optimizer, lr0, close_mosaic, validation, device, Ultralytics' workers), the
same machine (host, GPUs, driver, torch, CUDA, Ultralytics, Python, cores), the same build of ddp-launch (`code`: a
digest of its sources and configs), other seeds, and a variant's name always for the same overrides. The earlier run
folders are read, never written.
"""

from __future__ import annotations

import json
from pathlib import Path

# what must be equal for two invocations' sides to be compared as one benchmark's
SETTINGS = ("model", "imgsz", "epochs", "batch", "optimizer", "lr0", "close_mosaic", "val_interval", "device",
            "ultralytics_workers")
DATA = ("name", "path", "train_images", "val_images")
MACHINE = ("host", "gpus", "driver", "torch", "cuda", "ultralytics", "python", "cpu_count", "code")


def shape_problems(earlier) -> list[str]:
    """null, a path, or a list of paths: run folders of earlier time_to_model invocations (or their bench.json)."""
    if earlier is None:
        return []
    paths = paths_of(earlier)
    if not paths or not all(isinstance(p, str) and p for p in paths):
        return [f"bench.earlier={earlier!r}: expected an earlier time_to_model run folder, or a list of them, e.g. "
                "bench.earlier=runs/bench/EARLIER_RUN"]
    return []


def paths_of(earlier) -> list[str]:
    return [] if earlier is None else list(earlier) if isinstance(earlier, list) else [earlier]


def read(earlier, base_dir: Path, run_dir: Path) -> tuple[list[dict], list[str]]:
    """Each earlier invocation's bench.json (with "path", where it was read), and what is wrong with any of them.
    `run_dir`: this invocation's folder, whose bench.json it will write (so never an earlier one's)."""
    reports, problems = [], []
    for given in paths_of(earlier):
        path = Path(given).expanduser()
        path = (path if path.is_absolute() else base_dir / path).resolve()
        path = path / "bench.json" if path.is_dir() else path
        if path.parent == Path(run_dir).resolve():
            problems.append(f"bench.earlier: {path.parent} is this invocation's own run folder, whose report it "
                            "would replace; run it in a folder of its own (hydra.run.dir)")
            continue
        try:
            report = json.loads(path.read_text())
        except FileNotFoundError:
            problems.append(f"bench.earlier: {path} does not exist; give the run folder of an earlier "
                            "bench.kind=time_to_model invocation (it holds bench.json)")
            continue
        except (OSError, ValueError) as e:
            problems.append(f"bench.earlier: {path} cannot be read as a report ({e})")
            continue
        if not isinstance(report, dict) or report.get("kind") != "time_to_model":
            problems.append(f"bench.earlier: {path} is not a time_to_model report (bench.kind=time_to_model writes "
                            "one)")
            continue
        reports.append({**report, "path": str(path)})
    return reports, problems


def problems(reports: list[dict], settings: dict, environment: dict) -> list[str]:
    """Whether the earlier reports were measured as this invocation will be: their settings, their machine, their
    seeds (none twice) and their variants (a name, one set of overrides)."""
    out = []
    seeds = {s: "this invocation" for s in settings["seeds"]}
    variants = dict(settings.get("variants") or {})
    for report in reports:
        where, theirs, env = report["path"], report.get("settings") or {}, report.get("environment") or {}
        for key in SETTINGS:
            if theirs.get(key) != settings.get(key):
                out.append(f"bench.earlier: {where} ran with {key}={theirs.get(key)!r}, this invocation with "
                           f"{settings.get(key)!r}: give the same settings, or leave bench.earlier out")
        for key in DATA:
            if (theirs.get("data") or {}).get(key) != settings["data"].get(key):
                out.append(f"bench.earlier: {where} ran on data {key}={(theirs.get('data') or {}).get(key)!r}, this "
                           f"invocation on {settings['data'].get(key)!r}")
        for key in MACHINE:
            if env.get(key) == environment.get(key):
                continue
            if key == "code":
                out.append(f"bench.earlier: {where} measured another build of ddp-launch (code {env.get(key)!r}, "
                           f"here {environment.get(key)!r}); run its seeds again with this one")
            else:
                out.append(f"bench.earlier: {where} was measured on another machine ({key} {env.get(key)!r}, here "
                           f"{environment.get(key)!r}); only runs on one machine are reported together")
        for seed in theirs.get("seeds") or []:
            if seed in seeds:
                out.append(f"bench.earlier: seed {seed} is in {where} and in {seeds[seed]}; each seed once (run "
                           "the others with bench.seeds)")
            seeds.setdefault(seed, where)
        for name, overrides in (theirs.get("variants") or {}).items():
            if name in variants and list(variants[name]) != list(overrides):
                out.append(f"bench.earlier: variant {name} is {list(overrides)} in {where} but {list(variants[name])} "
                           "here; give another name to other overrides")
            variants.setdefault(name, list(overrides))
    return out


def combined(reports: list[dict], sides: list[dict], settings: dict) -> tuple[list[dict], dict, list[dict]]:
    """(every side, earlier ones first; the settings with every seed and variant; what came from where)."""
    every, seeds, variants, sources = [], [], {}, []
    for report in reports:
        theirs = report["settings"]
        # a side that came to that report from one before it keeps its own origin
        every += [s if "from" in s else {**s, "from": report["path"]} for s in report["sides"]]
        seeds += list(theirs["seeds"])
        variants.update(theirs.get("variants") or {})
        sources += report.get("earlier") or []
        sources.append({"path": report["path"], "command": report.get("command"),
                        "seeds": [s for s in theirs["seeds"] if not any(s in e["seeds"]
                                                                       for e in report.get("earlier") or [])]})
    variants.update(settings.get("variants") or {})
    return every + sides, {**settings, "seeds": seeds + list(settings["seeds"]), "variants": variants}, sources
