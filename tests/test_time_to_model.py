"""ddp-bench bench.kind=time_to_model: the breakdown of a side's wall clock from its timeline, the verdict, the
report; and the benchmark itself on the CPU, both sides for real on tiny data."""

from __future__ import annotations

import json
import math

import pytest

from launcher.bench import time_to_model as ttm
from launcher.bench import time_to_model_report as ttr
from tests.conftest import TINY, ddp_launch

T0 = 1000.0  # the side's command


def ddp_launch_timeline(**changes) -> dict:
    """Two epochs, both validated: start-up 12 s, training 20 + 18 s, validation 2 + 3 s, 1 + 0.5 s of epoch
    boundaries (0.25 + 0.25 s of them writing checkpoints), 4 s at the end (3 s of it the final validation)."""
    stamps = {"launcher_start": 1000.1, "torchrun_start": 1003.0, "rank_start": 1005.0, "imports_done": 1009.0,
              "components_built": 1011.5, "loop_start": 1011.6, "first_step": 1012.0, "last_epoch_end": 1056.5,
              "final_val_start": 1057.0, "final_val_end": 1060.0, "weights_start": 1060.0, "weights_end": 1060.5}
    epochs = [{"epoch": 1, "train_start": 1011.7, "train_end": 1032.0, "val_start": 1032.0, "val_end": 1034.0,
               "save_start": 1034.5, "save_end": 1034.75},
              {"epoch": 2, "train_start": 1035.0, "train_end": 1053.0, "val_start": 1053.0, "val_end": 1056.0,
               "save_start": 1056.0, "save_end": 1056.25}]
    for key, value in changes.items():
        epoch, _, name = key.partition("__")
        if name:
            epochs[int(epoch[1:]) - 1][name] = value
        else:
            stamps[key] = value
    return {"stamps": stamps, "epochs": epochs}


def test_the_parts_of_a_side_tile_its_wall_clock():
    out = ttm.breakdown(T0, ddp_launch_timeline())
    assert out["wall_s"] == pytest.approx(60.5)
    assert out["breakdown"] == pytest.approx({"startup": 12.0, "training": 38.0, "validation": 5.0,
                                              "boundaries": 1.5, "end": 4.0, "other": 0.0})
    assert out["end_parts"] == pytest.approx({"final_validation": 3.0, "checkpoints": 1.0})
    assert out["boundary_parts"] == pytest.approx({"checkpoints": 0.5, "other": 1.0})
    assert [e["training_s"] for e in out["epochs"]] == pytest.approx([20.0, 18.0])
    # the start-up's own parts, from the command to the first step
    assert [p["until"] for p in out["startup_parts"]] == ["launcher_start", "torchrun_start", "rank_start",
                                                          "imports_done", "components_built", "loop_start",
                                                          "first_step"]
    assert sum(p["s"] for p in out["startup_parts"]) == pytest.approx(12.0)
    assert ttm.timeline_in_order(T0, ddp_launch_timeline()) == []


def test_an_epoch_without_validation_adds_none_and_its_gap_is_a_boundary():
    timeline = ddp_launch_timeline()
    for key in ("val_start", "val_end"):
        del timeline["epochs"][0][key]
    out = ttm.breakdown(T0, timeline)
    assert out["breakdown"]["validation"] == pytest.approx(3.0)
    assert out["breakdown"]["boundaries"] == pytest.approx(3.5)  # epoch 1's training end to epoch 2's start
    assert out["epochs"][0]["validation_s"] is None
    assert sum(out["breakdown"].values()) == pytest.approx(out["wall_s"])


def test_a_timeline_out_of_order_is_named_and_its_overlap_is_left_as_other():
    timeline = ddp_launch_timeline(e2__train_start=1033.0)  # before epoch 1's validation ended
    out = ttm.breakdown(T0, timeline)
    assert out["breakdown"]["other"] == pytest.approx(-1.0)  # counted twice: training and validation overlap
    assert sum(out["breakdown"].values()) == pytest.approx(out["wall_s"])
    assert ttm.timeline_in_order(T0, timeline) == ["epoch 2 train_start (1033.000) before epoch 1 save_end (1034.750)"]


def test_the_sides_alternate_seed_by_seed_and_bad_seeds_are_named():
    assert ttm.run_order([0, 1]) == [("ultralytics", 0), ("ddp_launch", 0), ("ddp_launch", 1), ("ultralytics", 1)]
    assert ttm.problems({"seeds": None}) == []
    assert "expected a list of integer seeds" in ttm.problems({"seeds": "0,1"})[0]
    assert "each seed once" in ttm.problems({"seeds": [1, 1]})[0]
    assert "give train.batch_per_device as a number" in ttm.problems({"seeds": [0]}, {"batch_per_device": "auto"})[0]


def test_a_variant_is_a_side_of_its_own_whose_overrides_replace_the_shared_settings(tmp_path):
    """bench.variants: a ddp_launch-NAME side per seed beside the defaults (the order still reversed every other
    seed); its command is the defaults' with its overrides, one value per key (Hydra takes no key twice)."""
    sides = ttm.side_names({"every5": ["train.val_interval=5"]})
    assert ttm.run_order([0, 1], sides) == [("ultralytics", 0), ("ddp_launch", 0), ("ddp_launch-every5", 0),
                                            ("ddp_launch-every5", 1), ("ddp_launch", 1), ("ultralytics", 1)]
    cfg = {"train": {"imgsz": 640, "epochs": 10, "batch_per_device": 64, "close_mosaic": 5},
           "model": {"name": "yolov8s", "cfg": "yolov8s.yaml", "weights": None}, "optim": {"base_lr": 0.01},
           "paths": {"cache": "/c"}}
    base = ttm.ddp_launch_command(cfg, tmp_path / "d.yaml", 0, True, tmp_path / "run")
    varied = ttm.ddp_launch_command(cfg, tmp_path / "d.yaml", 0, True, tmp_path / "run",
                                    ["train.val_interval=5", "val.fold_batchnorm=true"])
    assert "train.val_interval=1" in base and "train.val_interval=1" not in varied
    assert varied == [a for a in base if a != "train.val_interval=1"] + ["train.val_interval=5",
                                                                           "val.fold_batchnorm=true"]
    assert ttm.problems({"variants": {"every5": ["train.val_interval=5"]}}) == []
    assert "letters, digits and underscores" in ttm.problems({"variants": {"every 5": ["train.val_interval=5"]}})[0]
    assert "a list of key=value overrides" in ttm.problems({"variants": {"x": "train.val_interval=5"}})[0]
    assert "expected {name: [key=value, ...]}" in ttm.problems({"variants": ["train.val_interval=5"]})[0]


def side(name: str, seed: int, wall: float, map50_95: float, data_wait: float | None) -> dict:
    parts = {"startup": 0.2 * wall, "training": 0.6 * wall, "validation": 0.1 * wall, "boundaries": 0.05 * wall,
             "end": 0.05 * wall, "other": 0.0}
    return {"name": name, "seed": seed, "wall_s": wall, "map50": 0.9, "map50_95": map50_95, "data_wait": data_wait,
            "gpu_util": None, "breakdown": parts, "after_weights": {"plots_s": 1.0, "exit_s": 1.0},
            "startup_parts": [{"until": "first_step", "what": "all of it", "s": 0.2 * wall}],
            "end_parts": {"final_validation": 0.03 * wall, "checkpoints": 0.02 * wall},
            "boundary_parts": {"checkpoints": 0.04 * wall, "other": 0.01 * wall}}


def test_input_bound_ultralytics_meets_the_target_with_the_same_map():
    out = ttr.summarize([side("ultralytics", 0, 100.0, 0.96, 0.30), side("ddp_launch", 0, 45.0, 0.965, 0.02),
                         side("ddp_launch", 1, 55.0, 0.955, 0.02), side("ultralytics", 1, 120.0, 0.97, 0.20)])
    assert out["means"]["ultralytics"]["wall_s"] == pytest.approx(110.0)
    assert out["ratio"] == pytest.approx(110.0 / 50.0)
    assert out["ratio_per_seed"] == pytest.approx({"0": 100 / 45, "1": 120 / 55})
    assert out["map50_95_diff"] == pytest.approx(-0.005)
    v = out["verdict"]
    assert v["met"] is True and v["input_bound"] is True
    assert "2.20x sooner" in v["text"] and "input-bound (25 % data wait): the 2.0x target is met" in v["text"]


def test_a_missed_target_names_what_bounds_ddp_launch():
    v = ttr.summarize([side("ultralytics", 0, 90.0, 0.96, 0.25), side("ddp_launch", 0, 60.0, 0.96, 0.02)])["verdict"]
    assert v["met"] is False
    assert "target is missed" in v["text"] and "ddp-launch's largest part: training 36.0 s (60 %)" in v["text"]


def test_a_fed_ultralytics_reports_the_ratio_without_judging_the_target():
    v = ttr.summarize([side("ultralytics", 0, 90.0, 0.96, 0.05), side("ddp_launch", 0, 60.0, 0.90, 0.02)])["verdict"]
    assert v["met"] is None and v["input_bound"] is False and not v["same_map"]
    assert "loader kept up (5 % data wait, under 15 %)" in v["text"] and "outside 0.01" in v["text"]


@pytest.mark.parametrize("task,words", [("segment", "mask mAP50-95"), ("pose", "pose mAP50-95")])
def test_a_segmentation_or_pose_race_is_judged_at_1_5x_at_the_same_quality_however_fed_ultralytics_is(task, words):
    """The two seeds' means: 1.41x misses, 1.6x meets, whatever Ultralytics' data wait; a quality off by more than
    0.01 misses at any ratio. The report's ratio line names the target."""
    def race(ours: float, quality: float) -> dict:
        sides = [side("ultralytics", 0, 141.0, 0.98, 0.02), side("ddp_launch", 0, ours, 0.98, 0.0)]
        sides[0]["quality"], sides[1]["quality"] = 0.93, quality
        return ttr.summarize(sides, task=task)

    for ours, quality, met in ((100.0, 0.935, False), (88.0, 0.935, True), (88.0, 0.91, False)):
        v = race(ours, quality)["verdict"]
        assert v["met"] is met and v["target"] == 1.5, (ours, quality, v)
        assert f"the 1.5x target at the same {words} is {'met' if met else 'missed'}" in v["text"]
    assert ttr.target_text(task) == f"target 1.5x at the same {words}."
    assert ttr.target_text("detect") == "target 2.0x where Ultralytics is input-bound (data wait >= 15 %)."


def test_a_failed_side_leaves_an_incomplete_verdict():
    out = ttr.summarize([side("ultralytics", 0, 90.0, 0.96, 0.05),
                         {"name": "ddp_launch", "seed": 0, "error": "exit code 1; see x.log"}])
    assert out["ratio"] is None and out["verdict"]["text"].startswith("incomplete")


def test_the_report_shows_each_run_the_means_the_ratio_and_the_verdict(tmp_path):
    out = ttr.summarize([side("ultralytics", 0, 100.0, 0.96, 0.30), side("ddp_launch", 0, 40.0, 0.965, 0.02)])
    out.update(kind="time_to_model", command="ddp-bench bench.kind=time_to_model", environment={
        "gpus": ["H200"], "torch": "2.11", "cpu_count": 16, "python": "3.12"}, settings={
        "model": "yolov8s.yaml", "data": {"train_images": 8000, "val_images": 800, "mean_train_file_kb": 126.3},
        "imgsz": 640, "epochs": 10, "batch": 64, "lr0": 0.01, "close_mosaic": 5, "device": "one GPU", "seeds": [0]})
    ttr.write(out, tmp_path)
    md = (tmp_path / "bench.md").read_text()
    assert "| ultralytics | 0 | 100.0 | 20.0 | 60.0 | 10.0 | 5.0 | 5.0 | 0.0 | 0.9000 | 0.9600 | 30.0 % | 2.0 |" in md
    assert "| **ddp_launch mean** | 1 run(s) | 40.0 |" in md and "**2.50x** (seed 0: 2.50x)" in md
    assert out["verdict"]["text"] in md and "126 kB per train file" in md
    assert "boundaries: checkpoint writes 1.6 s, the rest 0.4 s" in md  # ddp-launch's, 40 s x 4 % and 1 %
    assert json.loads((tmp_path / "bench.json").read_text())["ratio"] == pytest.approx(2.5)
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_a_variant_is_reported_against_the_defaults_and_ultralytics_outside_the_verdict(tmp_path):
    variants = {"folded": ["val.fold_batchnorm=true"], "broken": ["train.val_interval=5"]}
    out = ttr.summarize([side("ultralytics", 0, 100.0, 0.96, 0.30), side("ddp_launch", 0, 50.0, 0.965, 0.02),
                         side("ddp_launch-folded", 0, 40.0, 0.964, 0.02),
                         {"name": "ddp_launch-broken", "seed": 0, "error": "exit code 1; see x.log"}], variants)
    assert out["ratio"] == pytest.approx(2.0) and out["verdict"]["met"] is True  # the defaults' alone
    folded = out["variants"]["folded"]
    assert folded["vs_defaults"] == pytest.approx(1.25) and folded["vs_ultralytics"] == pytest.approx(2.5)
    assert out["variants"]["broken"]["wall_s"] is None
    out.update(kind="time_to_model", command="ddp-bench bench.kind=time_to_model", environment={
        "gpus": ["H200"], "torch": "2.11", "cpu_count": 16, "python": "3.12"}, settings={
        "model": "yolov8s.yaml", "data": {"train_images": 8000, "val_images": 800, "mean_train_file_kb": 126.3},
        "imgsz": 640, "epochs": 10, "batch": 64, "lr0": 0.01, "close_mosaic": 5, "device": "one GPU", "seeds": [0],
        "variants": variants})
    ttr.write(out, tmp_path)
    md = (tmp_path / "bench.md").read_text()
    assert ("- ddp_launch-folded (`val.fold_batchnorm=true`): 40.0 s, mAP50-95 0.9640; the defaults' wall clock / "
            "its: 1.250x, Ultralytics' / its: 2.50x") in md
    assert "- ddp_launch-broken (`train.val_interval=5`): failed" in md
    assert "| ddp_launch-folded | 0 | 40.0 |" in md and "**2.00x** (seed 0: 2.00x)" in md


def test_the_ultralytics_callbacks_stamp_its_epochs_and_the_end_after_final_eval():
    """The callbacks in the order Ultralytics' trainer fires them (engine/trainer.py): the final weights are on disk
    once final_eval has stripped them and validated best.pt."""
    import torch

    from launcher.rank.metrics.meter import StepMeter
    from launcher.rank.ultralytics.time_to_model_ultralytics import Stamps

    clock = iter(range(100, 200)).__next__
    stamps = Stamps(StepMeter(torch.device("cpu"), skip_steps=0), clock=lambda: float(clock()))
    calls = stamps.callbacks()
    save_model = stamps.save(lambda trainer: True)
    trainer = type("Trainer", (), {"epoch": 0, "batch_size": 4})()
    for name in ("on_pretrain_routine_start", "on_pretrain_routine_end", "on_train_start"):
        calls[name](trainer)
    for epoch in range(2):
        trainer.epoch = epoch
        calls["on_train_epoch_start"](trainer)
        for _ in range(2):
            calls["on_train_batch_start"](trainer)
            calls["on_train_batch_end"](trainer)
        for name in ("on_train_epoch_end", "on_val_start", "on_val_end"):
            calls[name](trainer)
        assert save_model(trainer) is True  # Ultralytics' own return value passes through
        calls["on_fit_epoch_end"](trainer)
    strip = stamps.strip(lambda f, updates=None: {})
    strip("last.pt")
    strip("best.pt")
    for name in ("on_val_start", "on_val_end", "on_fit_epoch_end", "on_train_end"):  # final_eval, then plots
        calls[name](trainer)
    timeline = stamps.to_dict()
    s = timeline["stamps"]
    assert s["first_step"] == 104 and s["last_epoch_end"] == s["stripped"] - 2
    assert (s["final_val_start"], s["final_val_end"]) == (s["stripped"], s["weights_end"]) and s["plots_end"] > s["weights_end"]
    assert [sorted(e) for e in timeline["epochs"]] == [["end", "epoch", "save_end", "save_start", "train_end",
                                                        "train_start", "val_end", "val_start"]] * 2
    assert all(e["save_end"] - e["save_start"] == 1 for e in timeline["epochs"])
    assert ttm.timeline_in_order(99.0, timeline) == []
    out = ttm.breakdown(99.0, timeline)
    assert out["breakdown"]["other"] == 0 and out["end_parts"]["final_validation"] == 1
    assert out["boundary_parts"] == {"checkpoints": 2.0, "other": out["breakdown"]["boundaries"] - 2.0}
    assert [p["until"] for p in out["startup_parts"]][-1] == "first_step"


@pytest.mark.slow
def test_the_benchmark_on_the_cpu_reports_both_sides_and_parts_that_add_up(tmp_path, cache_dir):
    """Both sides for real, tiny data, and a variant of ddp-launch's (bench.variants): each side's wall clock is its
    breakdown's parts, the ddp-launch side's timeline is in order, the variant ran with its override, and the
    report's three files agree. Then seed 1 planned with bench.earlier (a dry run) takes this report as its earlier one."""
    out = tmp_path / "b"
    tiny = [a for a in TINY if not a.startswith(("data.synthetic.train_images", "data.synthetic.val_images",
                                                 "train.close_mosaic"))]
    args = ["bench.kind=time_to_model", "gpus=0", "data=shapes", "data.synthetic.train_images=16",
            "data.synthetic.val_images=8", "train.epochs=1", "train.close_mosaic=0", *tiny,
            'bench.variants={folded:["val.fold_batchnorm=true"]}', f"hydra.run.dir={out}"]
    result = ddp_launch(args, cwd=tmp_path, timeout=600, tool="ddp-bench")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    assert report["kind"] == "time_to_model" and (out / "bench.png").stat().st_size > 0
    sides = {s["name"]: s for s in report["sides"]}
    assert set(sides) == {"ultralytics", "ddp_launch", "ddp_launch-folded"}
    assert sides["ddp_launch-folded"]["command_line"][-1] == "val.fold_batchnorm=true"
    logs = {name: (out / f"{name}-seed0" / "run" / "logs" / "rank0.log").read_text()
            for name in ("ddp_launch", "ddp_launch-folded")}
    assert "BatchNorms folded" in logs["ddp_launch-folded"] and "BatchNorms folded" not in logs["ddp_launch"]
    assert report["variants"]["folded"]["vs_defaults"] > 0
    md = (out / "bench.md").read_text()
    for name, s in sides.items():
        assert math.isfinite(s["map50"]) and math.isfinite(s["map50_95"]), s
        parts = s["breakdown"]
        assert sum(v for k, v in parts.items() if k != "other") == pytest.approx(s["wall_s"], rel=0.01), parts
        assert all(v >= 0 for k, v in parts.items() if k != "other"), parts
        assert s["wall_s"] < s["process_s"] and s["timeline_problems"] == [], s
        assert [e["epoch"] for e in s["epochs"]] == [1] and s["epochs"][0]["validation_s"] > 0
        assert 0 < s["boundary_parts"]["checkpoints"] <= parts["boundaries"], s  # each side saved after its epoch
        assert f"| {name} | 0 | {s['wall_s']:.1f} |" in md
    d = sides["ddp_launch"]["timeline"]["stamps"]
    order = ["launcher_start", "torchrun_start", "rank_start", "imports_done", "components_built", "first_step",
             "last_epoch_end", "final_val_start", "final_val_end", "weights_end", "end"]
    assert [d[k] for k in order] == sorted(d[k] for k in order), d
    setup = sides["ddp_launch"]["setup_parts"]  # the rank's set-up, from its imports to its components
    assert [p["part"] for p in setup[:3]] == ["cuda_init", "hyperparameters_and_seeds", "dataset_check"]
    assert all(p["s"] >= 0 for p in setup) and sum(p["s"] for p in setup) <= d["components_built"] - d["imports_done"]
    assert report["ratio"] == pytest.approx(sides["ultralytics"]["wall_s"] / sides["ddp_launch"]["wall_s"])

    # seed 1 planned with bench.earlier: this invocation's report is read and taken, the sides' order goes on
    # alternating (seed 1 starts with ddp-launch's); the combined report is tests/test_time_to_model_earlier.py's
    args = [a for a in args if not a.startswith(("bench.variants", "hydra.run.dir"))]
    planned = ddp_launch([*args, "bench.seeds=[1]", f"bench.earlier={out}", f"hydra.run.dir={tmp_path / 'b1'}",
                          "dry_run=true"], cwd=tmp_path, timeout=300, tool="ddp-bench")
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-3000:]
    assert f"reported with the sides of seeds [0] from {out}" in planned.stdout
    lines = [line.split(":")[0].strip() for line in planned.stdout.splitlines() if " seed 1: " in line]
    assert lines == ["ddp_launch seed 1", "ultralytics seed 1"], planned.stdout[-3000:]



def test_the_launch_settings_given_to_ddp_bench_reach_the_ddp_launch_sides_and_a_variant_replaces_them():
    """`ddp-bench +experiment=time_to_model loader.augment_on=gpu` runs its ddp-launch sides with the GPU input; the
    shared settings and ddp-bench's own groups reach the sides otherwise, and a variant's key wins over the same key."""
    given = ["+experiment=time_to_model", "data=shapes_time_to_model", "data.synthetic.train_images=3000",
             "model=custom", "model.cfg=yolov8s-seg.yaml", "train.imgsz=320", "seed=3", "gpus=1", "bench.seeds=[0,1]",
             "hydra.run.dir=/x", "paths.cache=/c", "dry_run=true", "loader.augment_on=gpu",
             "+train.extra.degrees=10", "optim.momentum=0.9"]
    assert ttm.launch_overrides(given) == ["loader.augment_on=gpu", "+train.extra.degrees=10", "optim.momentum=0.9"]
    variants = {"cpu_input": ["loader.augment_on=cpu"]}
    assert ttm._overrides("ddp_launch", variants, given) == ttm.launch_overrides(given)
    assert ttm._overrides("ddp_launch-cpu_input", variants, given) == ["+train.extra.degrees=10", "optim.momentum=0.9",
                                                                       "loader.augment_on=cpu"]
    assert ttm._overrides("ultralytics", variants, given) == ttm.launch_overrides(given)  # run_side reads them not


def test_sigterm_to_ddp_bench_stops_the_side_it_is_running_and_leaves_no_process(tmp_path, cache_dir):
    """What `timeout` and a scheduler send: ddp-bench forwards it to the side in progress (here the first, Ultralytics'
    trainer, in its first epochs), waits for it, says so in a line, writes the report of what ran, and exits 143;
    nothing it started is left running (its sides' command lines, and their workers', hold the run folder)."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.test_faults import gone_within

    out = tmp_path / "b"
    args = ["bench.kind=time_to_model", "gpus=0", "data=shapes", "train.epochs=100", f"paths.cache={cache_dir}", *TINY,
            f"hydra.run.dir={out}"]
    bench = subprocess.Popen([str(Path(sys.executable).parent / "ddp-bench"), *args], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = out / "ultralytics-seed0" / "ultralytics" / "results.csv"  # written after each epoch
    deadline = time.time() + 180
    while time.time() < deadline and not results.is_file():
        assert bench.poll() is None, bench.stdout.read()
        time.sleep(0.5)
    assert results.is_file(), "Ultralytics' side never finished an epoch"
    bench.send_signal(signal.SIGTERM)
    said, _ = bench.communicate(timeout=120)
    assert bench.returncode == 128 + signal.SIGTERM, said[-3000:]
    assert "ddp-bench: stopped by SIGTERM" in said, said[-3000:]
    report = json.loads((out / "bench.json").read_text())  # what ran so far, the stopped side failed
    assert [(s["name"], s["error"]) for s in report["sides"]] == [("ultralytics", "stopped by SIGTERM")]
    assert gone_within(out, 30) == [], "processes ddp-bench started outlived it"


def test_a_folder_that_holds_a_benchmark_is_refused_before_any_side_runs(tmp_path):
    """hydra.run.dir given twice: the second invocation is refused in one line, not after Ultralytics' side has run
    and ddp-launch's has refused its run folder."""
    for earlier in ("bench.json", "ddp_launch-seed0/", "cells/"):
        out = tmp_path / earlier.strip("/").replace(".", "_")
        (out / earlier).mkdir(parents=True) if earlier.endswith("/") else (out.mkdir(), (out / earlier).write_text("{}"))
        result = ddp_launch(["bench.kind=time_to_model", "gpus=0", "data=shapes", f"hydra.run.dir={out}"], cwd=tmp_path,
                            timeout=120, tool="ddp-bench")
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
        assert f"{out} already holds a benchmark; choose another hydra.run.dir=PATH" in result.stderr
        assert "--- ultralytics" not in result.stdout
