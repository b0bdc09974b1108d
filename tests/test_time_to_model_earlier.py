"""bench.earlier: an earlier time_to_model invocation's sides reported with this one's, only where they were
measured the same way, on the same machine, with other seeds (the two-invocation run itself is in
test_time_to_model.py's CPU benchmark)."""

from __future__ import annotations

import json

from launcher.bench import time_to_model as ttm
from launcher.bench import time_to_model_earlier as earlier
from tests.conftest import TINY, ddp_launch

SETTINGS = {"model": "yolov8s.yaml", "data": {"name": "shapes", "path": "/d", "train_images": 8000, "val_images": 800,
                                               "mean_train_file_kb": 124.0},
            "imgsz": 640, "epochs": 10, "batch": 64, "optimizer": "SGD", "lr0": 0.01, "close_mosaic": 5,
            "seeds": [1], "val_interval": 1, "device": "one GPU", "ultralytics_workers": 8, "variants": {}}
MACHINE = {"host": "h200-a", "gpus": ["NVIDIA H200"], "driver": "580", "torch": "2.11.0", "cuda": "13.0",
           "ultralytics": "8.4.190", "python": "3.12.3", "cpu_count": 16, "code": "9c0cf285aaf3b477"}


def report(path: str, seeds=(0,), variants=None, **changes) -> dict:
    settings = {**SETTINGS, "seeds": list(seeds), "variants": dict(variants or {})}
    machine = dict(MACHINE)
    for key, value in changes.items():
        (machine if key in MACHINE else settings)[key] = value
    sides = [{"name": name, "seed": s, "wall_s": 1.0} for s in seeds for name in ("ultralytics", "ddp_launch")]
    return {"kind": "time_to_model", "command": f"ddp-bench seeds {list(seeds)}", "settings": settings,
            "environment": machine, "sides": sides, "path": path}


def test_only_runs_measured_the_same_way_on_this_machine_with_other_seeds_are_put_together():
    assert earlier.problems([report("/a/bench.json")], SETTINGS, MACHINE) == []
    said = earlier.problems([report("/a/bench.json", seeds=(0, 1), epochs=5, host="h200-b", torch="2.10.0",
                                    code="0123456789abcdef")], SETTINGS, MACHINE)
    assert len(said) == 5, said
    assert "/a/bench.json ran with epochs=5, this invocation with 10" in said[0]
    assert "measured on another machine (host 'h200-b', here 'h200-a')" in said[1]
    assert "(torch '2.10.0', here '2.11.0')" in said[2]
    assert "measured another build of ddp-launch (code '0123456789abcdef', here '9c0cf285aaf3b477')" in said[3]
    assert "seed 1 is in /a/bench.json and in this invocation; each seed once" in said[4]
    data = {**SETTINGS["data"], "path": "/other"}
    assert "ran on data path='/other', this invocation on '/d'" in earlier.problems(
        [report("/a/bench.json", data=data)], SETTINGS, MACHINE)[0]
    # a report written before the host was recorded cannot show it came from this machine
    older = report("/a/bench.json")
    del older["environment"]["host"]
    assert "another machine (host None" in earlier.problems([older], SETTINGS, MACHINE)[0]


def test_a_variant_keeps_one_meaning_across_invocations():
    mine = {**SETTINGS, "variants": {"folded": ["val.fold_batchnorm=true"]}}
    same = report("/a/bench.json", variants={"folded": ["val.fold_batchnorm=true"]})
    assert earlier.problems([same], mine, MACHINE) == []
    other = report("/a/bench.json", variants={"folded": ["train.val_interval=5"]})
    assert "variant folded is ['train.val_interval=5'] in /a/bench.json but ['val.fold_batchnorm=true'] here" in \
        earlier.problems([other], mine, MACHINE)[0]


def test_what_cannot_be_read_is_named_and_this_invocations_own_folder_is_refused(tmp_path):
    (tmp_path / "bench-a").mkdir()
    (tmp_path / "bench-a" / "bench.json").write_text(json.dumps({"kind": "throughput"}))
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "mine").mkdir()
    reports, said = earlier.read(["missing", "bench-a", str(tmp_path / "broken.json"), "mine"], tmp_path,
                                 tmp_path / "mine")
    assert reports == [] and len(said) == 4, said
    assert "missing does not exist; give the run folder of an earlier bench.kind=time_to_model" in said[0]
    assert "bench-a/bench.json is not a time_to_model report" in said[1]
    assert "broken.json cannot be read as a report" in said[2]
    assert "is this invocation's own run folder, whose report it would replace" in said[3]
    good = report("x")
    del good["path"]
    (tmp_path / "seed0").mkdir()
    (tmp_path / "seed0" / "bench.json").write_text(json.dumps(good))
    reports, said = earlier.read("seed0", tmp_path, tmp_path / "mine")  # one folder, relative to where ddp-bench ran
    assert said == [] and reports[0]["path"] == str(tmp_path / "seed0" / "bench.json")
    assert "expected an earlier time_to_model run folder" in earlier.shape_problems(["a", 3])[0]
    assert "expected an earlier time_to_model run folder" in ttm.problems({"earlier": {"a": 1}})[0]


def test_the_combined_report_holds_every_side_seed_and_variant_and_where_each_came_from():
    first = report("/a/bench.json", seeds=(0,), variants={"folded": ["val.fold_batchnorm=true"]})
    first["earlier"] = []
    mine = [{"name": "ddp_launch", "seed": 1, "wall_s": 1.0}, {"name": "ultralytics", "seed": 1, "wall_s": 1.0}]
    sides, settings, sources = earlier.combined([first], mine, {**SETTINGS, "variants": {"every5": ["x=5"]}})
    assert [(s["seed"], s.get("from")) for s in sides] == [(0, "/a/bench.json")] * 2 + [(1, None)] * 2
    assert settings["seeds"] == [0, 1]
    assert settings["variants"] == {"folded": ["val.fold_batchnorm=true"], "every5": ["x=5"]}
    assert sources == [{"path": "/a/bench.json", "command": "ddp-bench seeds [0]", "seeds": [0]}]
    # a third invocation that names the second: the first's sides keep their origin
    second = {**report("/b/bench.json", seeds=(0, 1)), "sides": sides, "earlier": sources}
    sides3, settings3, sources3 = earlier.combined([second], [], {**SETTINGS, "seeds": [2]})
    assert [s.get("from") for s in sides3] == ["/a/bench.json"] * 2 + ["/b/bench.json"] * 2
    assert settings3["seeds"] == [0, 1, 2]
    assert [(s["path"], s["seeds"]) for s in sources3] == [("/a/bench.json", [0]), ("/b/bench.json", [1])]


def test_the_sides_order_goes_on_alternating_after_the_earlier_seeds():
    assert ttm.run_order([1], first=1) == [("ddp_launch", 1), ("ultralytics", 1)]
    assert ttm.run_order([2], first=2) == [("ultralytics", 2), ("ddp_launch", 2)]


def test_earlier_is_refused_for_a_throughput_benchmark(tmp_path):
    r = ddp_launch(["bench.kind=throughput", "gpus=0", "dry_run=true", "bench.earlier=x", *TINY], cwd=tmp_path,
                   tool="ddp-bench")
    assert r.returncode != 0 and "bench.earlier is for bench.kind=time_to_model" in r.stdout + r.stderr


def test_the_code_digest_changes_with_any_source_or_config_file(tmp_path, monkeypatch):
    from launcher.bench import report as bench_report

    package, conf = tmp_path / "launcher", tmp_path / "conf"
    (package / "bench").mkdir(parents=True)
    conf.mkdir()
    (package / "bench" / "report.py").write_text("x = 1\n")
    (conf / "config.yaml").write_text("a: 1\n")
    monkeypatch.setattr(bench_report, "__file__", str(package / "bench" / "report.py"))
    monkeypatch.setattr(bench_report, "conf_dir", lambda: str(conf))
    first = bench_report.code_digest()
    (conf / "config.yaml").write_text("a: 2\n")
    second = bench_report.code_digest()
    (package / "bench" / "report.py").write_text("x = 2\n")
    assert len({first, second, bench_report.code_digest()}) == 3
