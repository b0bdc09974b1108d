"""Bad images and labels (issue 16, defects 2 and 4): the plan counts what Ultralytics will really use per split, says
what it drops and why, refuses a split left empty, and the final lines and summary.json repeat it."""

from __future__ import annotations

import io
import json
import os
import shutil
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from PIL import Image

from launcher.inputs import labels
from launcher.inputs.data import resolve_data
from launcher.launch.outcome import report
from launcher.launch.start import start as launch
from launcher.problems import PlanError
from launcher.run_folder import RunFolder
from tests.conftest import compose_config

NAMES = ["a", "b", "c"]
GOOD = "0 0.5 0.5 0.2 0.2\n1 0.3 0.3 0.1 0.1\n"


def _jpeg(size=(64, 48), mode="RGB") -> bytes:
    rng = np.random.default_rng(sum(size))
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, shape, np.uint8), mode).save(buf, "JPEG" if mode == "RGB" else "PNG")
    return buf.getvalue()


def _write(root: Path, split: str, name: str, image: bytes, label: str | None) -> None:
    (root / "images" / split).mkdir(parents=True, exist_ok=True)
    (root / "labels" / split).mkdir(parents=True, exist_ok=True)
    (root / "images" / split / name).write_bytes(image)
    if label is not None:
        (root / "labels" / split / name).with_suffix(".txt").write_text(label)


def box_dataset(root: Path) -> Path:
    """One image with box rows (class x y w h) in each split, and the data YAML naming them."""
    for split in ("train", "val"):
        _write(root, split, "a.jpg", _jpeg(), GOOD)
    data = root / "data.yaml"
    data.write_text(yaml.safe_dump({"path": str(root), "train": "images/train", "val": "images/val", "names": NAMES}))
    return data


def issue_dataset(root: Path) -> Path:
    """The issue's mix among good images: 24 train, 8 val."""
    for i in range(14):
        _write(root, "train", f"good{i:02d}.jpg", _jpeg(), GOOD)
    whole = _jpeg((96, 96))
    _write(root, "train", "truncated.jpg", whole[: len(whole) * 2 // 3], GOOD)
    _write(root, "train", "random.jpg", os.urandom(3000), GOOD)
    _write(root, "train", "bigclass.jpg", _jpeg(), "5 0.5 0.5 0.2 0.2\n")
    _write(root, "train", "outside.jpg", _jpeg(), "0 1.4 0.5 0.2 0.2\n")
    _write(root, "train", "negative.jpg", _jpeg(), "0 -0.3 0.5 0.2 0.2\n")
    _write(root, "train", "nolabel.jpg", _jpeg(), None)
    _write(root, "train", "gray.png", _jpeg(mode="L"), GOOD)
    _write(root, "train", "ten.jpg", _jpeg((10, 10)), GOOD)
    _write(root, "train", "nine.jpg", _jpeg((9, 30)), GOOD)
    _write(root, "train", "dupes.jpg", _jpeg(), GOOD + GOOD)
    for i in range(7):
        _write(root, "val", f"good{i}.jpg", _jpeg(), GOOD)
    _write(root, "val", "random.jpg", os.urandom(500), GOOD)
    data = root / "data.yaml"
    data.write_text(yaml.safe_dump({"path": str(root), "train": "images/train", "val": "images/val", "names": NAMES}))
    return data


@pytest.fixture()
def dataset(tmp_path) -> Path:
    return issue_dataset(tmp_path / "ds")


def ultralytics_dropped(root: Path, split: str) -> set[str]:
    """The images Ultralytics' own verify_image_label drops, run on a copy (it rewrites JPEGs it can restore)."""
    from ultralytics.data.utils import img2label_paths, verify_image_label

    copy = root.parent / f"copy-{split}"
    shutil.copytree(root, copy)
    images = labels.list_images([str(copy / "images" / split)])
    dropped = set()
    for im, lb in zip(images, img2label_paths(images)):
        result = verify_image_label((im, lb, "", False, len(NAMES), 0, 0, False))
        if result[0] is None:
            dropped.add(Path(im).name)
    return dropped


def test_the_check_drops_exactly_what_ultralytics_drops_with_a_reason_each(dataset, tmp_path):
    root = dataset.parent
    for split in ("train", "val"):
        check = labels.check_split([str(root / "images" / split)], len(NAMES))
        ours = {Path(f).name for files in check.dropped.values() for f in files}
        assert ours == ultralytics_dropped(root, split), split
        assert check.usable == check.images - len(ours)
    train = labels.check_split([str(root / "images" / "train")], len(NAMES)).to_dict()
    reasons = {name: reason for reason, r in train["dropped"].items() for name in r["first"]}
    assert reasons["random.jpg"] == labels.UNIDENTIFIED  # never "No module named 'pi_heif'"
    assert reasons["truncated.jpg"] == labels.TRUNCATED
    assert reasons["bigclass.jpg"].startswith("class id >= nc (3 classes")
    assert reasons["outside.jpg"].startswith("label coordinates above 1")
    assert reasons["negative.jpg"] == "negative label values"
    assert reasons["nine.jpg"] == labels.TOO_SMALL
    assert (train["images"], train["usable"]) == (24, 18)
    kept = {reason: r["first"] for reason, r in train["kept"].items()}
    assert kept[labels.BACKGROUND_MISSING] == ["nolabel.jpg"] and kept[labels.DUPLICATES] == ["dupes.jpg"]


def test_verdicts_are_cached_by_size_and_mtime(dataset, tmp_path, monkeypatch):
    root, cache = dataset.parent, tmp_path / "cache"
    first = labels.check_split([str(root / "images" / "train")], len(NAMES), cache_dir=cache)
    calls = []
    monkeypatch.setattr(labels, "check_pair", lambda *a: calls.append(a[0]) or (None, None, 0, None))
    assert labels.check_split([str(root / "images" / "train")], len(NAMES), cache_dir=cache) == first
    assert calls == []  # nothing re-read
    (root / "labels" / "train" / "good00.txt").write_text("7 0.5 0.5 0.1 0.1\n")  # changed: checked again
    labels.check_split([str(root / "images" / "train")], len(NAMES), cache_dir=cache)
    assert [Path(c).name for c in calls] == ["good00.jpg"]


def dry_run_output(cfg: dict, tmp_path: Path) -> str:
    """What a dry run of `cfg` prints."""
    out = io.StringIO()
    with redirect_stdout(out):
        assert launch(cfg, tmp_path / "run", tmp_path) == 0
    return out.getvalue()


def test_the_plan_shows_the_counts_and_reasons_and_summary_json_holds_them(dataset, tmp_path, cache_dir):
    cfg = compose_config(["data=custom", f"data.path={dataset}", "gpus=0", "dry_run=true"])
    text = dry_run_output(cfg, tmp_path)
    assert "(18 of 24 train / 7 of 8 val images usable)" in text
    assert "6 of 24 train images dropped: " in text and "random.jpg" in text and labels.UNIDENTIFIED in text
    assert "1 of 8 val images dropped: 1 " + labels.UNIDENTIFIED + " (random.jpg)" in text

    from launcher.inputs.data import resolve_data
    from launcher.machine.hardware import Hardware
    from launcher.plan.plan import make_plan
    from launcher.rank.metrics.run_summary import summary

    data, _ = resolve_data(cfg["data"], tmp_path)
    plan, _ = make_plan(cfg, Hardware(gpus=(), cpu_count=2), data)
    assert plan.train_images == 18  # the steps per epoch follow what Ultralytics trains on
    state = SimpleNamespace(metrics={}, epoch=0, validated_epochs=[1], fitness_epoch=1, resumed_from=None)
    rank = {"images_per_s": 0.0, "steps_measured": 0, "data_wait": 0.0, "params_sha256": "x", "loss": {}}
    s = summary(plan=plan, state=state, epochs=1, reports=[rank], weights="w", last="l", run_dir=tmp_path, started=0)
    s = json.loads(json.dumps(s))
    assert s["images"]["train"]["usable"] == 18 and s["images"]["val"]["usable"] == 7
    assert s["images"]["train"]["dropped"][labels.TRUNCATED] == {"count": 1, "first": ["truncated.jpg"]}

    # the final lines of a finished run repeat them; a run too short for the meter's window says so, not "0.0"
    folder = RunFolder(tmp_path / "done")
    folder.write_json("summary.json", s)
    out = io.StringIO()
    with redirect_stdout(out):
        assert report(folder, 0, None, 0) == 0
    assert s["images_per_s"] is None and "0.0 images/s" not in out.getvalue()
    assert "too short for a steady-state images/s" in out.getvalue()
    assert "data        6 of 24 train images dropped" in out.getvalue()


def test_an_empty_validation_folder_is_refused_and_a_dry_run_warns(dataset, tmp_path, cache_dir):
    for f in (dataset.parent / "images" / "val").iterdir():
        f.unlink()
    cfg = compose_config(["data=custom", f"data.path={dataset}", "gpus=0"])
    with pytest.raises(PlanError, match=r"no images under .*images/val \(val split\)"):
        launch(cfg, tmp_path / "run", tmp_path)
    assert not (tmp_path / "run" / "plan.json").exists()
    out = io.StringIO()
    with redirect_stdout(out):
        assert launch({**cfg, "dry_run": True}, tmp_path / "dry", tmp_path) == 0
    assert "WARNING: dataset 'data': no images under" in out.getvalue()


def test_a_split_with_no_usable_image_or_no_label_file_is_refused(tmp_path):
    root = tmp_path / "ds"
    _write(root, "train", "random.jpg", os.urandom(100), GOOD)
    _write(root, "val", "v.jpg", _jpeg(), GOOD)
    data = root / "data.yaml"
    data.write_text(yaml.safe_dump({"train": "images/train", "val": "images/val", "names": NAMES}))
    _, problems = resolve_data({"name": "custom", "path": str(data)}, tmp_path)
    assert [p.message for p in problems] == [
        f"dataset 'data': none of the 1 train images under {root}/images/train can be used "
        f"(1 {labels.UNIDENTIFIED}); fix or replace them"]
    (root / "images" / "train" / "random.jpg").write_bytes(_jpeg())
    shutil.rmtree(root / "labels" / "train")
    _, problems = resolve_data({"name": "custom", "path": str(data)}, tmp_path)
    assert "no label file for any of the 1 training images" in problems[0].message
    assert f"{root}/labels/train/random.txt" in problems[0].message


def test_the_rank_side_names_an_unreadable_file_instead_of_the_missing_heif_plugin():
    import logging

    from launcher.rank.ultralytics import datasets

    record = logging.LogRecord("ultralytics", logging.INFO, "", 0,
                               "train: /d/x.jpg: ignoring corrupt image/label: No module named 'pi_heif'", None, None)
    datasets.LOGGER.filter(record)
    assert record.msg == f"train: /d/x.jpg: ignoring corrupt image/label: {labels.UNIDENTIFIED}"


def test_the_split_lists_the_files_ultralytics_lists(tmp_path):
    """Nested and linked folders, hidden files and folders, suffixes in any case, other files: the plan counts the
    images Ultralytics' BaseDataset.get_img_files finds (a link back to a parent folder is not followed round)."""
    from types import SimpleNamespace

    from ultralytics.data.base import BaseDataset

    root, elsewhere = tmp_path / "images", tmp_path / "elsewhere"
    for folder in (root / "a" / "b", root / ".hidden", elsewhere):
        folder.mkdir(parents=True)
    for path in (root / "1.jpg", root / "2.JPG", root / "a" / "3.png", root / "a" / "b" / "4.webp",
                 root / ".5.jpg", root / ".hidden" / "6.jpg", root / "notes.txt", root / "noext",
                 elsewhere / "7.jpg"):
        path.write_bytes(b"x")
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    (root / "8.jpg").symlink_to(elsewhere / "7.jpg")
    theirs = BaseDataset.get_img_files(SimpleNamespace(prefix="", fraction=1.0), str(root))
    assert labels.list_images([str(root)]) == theirs
    assert [Path(f).name for f in theirs] == ["1.jpg", "2.JPG", "8.jpg", "3.png", "4.webp", "7.jpg"]

    (root / "a" / "b" / "up").symlink_to(root / "a", target_is_directory=True)  # glob would go round it
    assert labels.list_images([str(root)]) == theirs


def test_the_check_counts_the_most_boxes_a_usable_image_trains_on(tmp_path):
    """The plan's most_boxes (what the captured step's target buckets are sized by) counts the boxes Ultralytics
    keeps: duplicate rows once, and nothing of a dropped image however crowded."""
    crowded = "".join(f"0 0.5 0.5 0.{i + 1} 0.1\n" for i in range(6))
    _write(tmp_path, "train", "two.jpg", _jpeg(), GOOD)
    _write(tmp_path, "train", "six.jpg", _jpeg(), crowded + crowded)  # 12 rows, 6 after duplicates go
    _write(tmp_path, "train", "dropped.jpg", _jpeg(), crowded + "7 0.5 0.5 0.2 0.2\n")  # class 7 >= nc: dropped
    check = labels.check_split([str(tmp_path / "images" / "train")], len(NAMES), cache_dir=tmp_path / "cache")
    assert check.usable == 2 and check.to_dict()["most_boxes"] == 6
    again = labels.check_split([str(tmp_path / "images" / "train")], len(NAMES), cache_dir=tmp_path / "cache")
    assert again.most_boxes == 6  # read from the verdicts' cache


def test_orphan_label_files_and_images_sharing_one_label_file_are_named_in_the_plan(tmp_path, cache_dir):
    """Label files whose images were deleted, and a.jpg beside a.png (both read a.txt): Ultralytics says nothing of
    either; the plan warns with the files, and a shared label file is counted once."""
    root = tmp_path / "ds"
    for i in range(4):
        _write(root, "train", f"img{i}.jpg", _jpeg(), GOOD)
    _write(root, "train", "pair.jpg", _jpeg(), GOOD)
    _write(root, "train", "pair.png", _jpeg(mode="L"), None)  # reads pair.txt, written beside pair.jpg
    for name in ("gone1.txt", "gone2.txt"):
        (root / "labels" / "train" / name).write_text(GOOD)
    for i in range(2):
        _write(root, "val", f"v{i}.jpg", _jpeg(), GOOD)
    data = root / "data.yaml"
    data.write_text(yaml.safe_dump({"path": str(root), "train": "images/train", "val": "images/val", "names": NAMES}))

    check = labels.check_split([str(root / "images" / "train")], len(NAMES)).to_dict()
    assert check["images"] == 6 and check["usable"] == 6 and check["labels_found"] == 5
    assert check["orphan_labels"] == {"count": 2, "first": ["gone1.txt", "gone2.txt"]}
    assert check["shared_labels"] == {"count": 1, "first": ["pair.txt <- pair.jpg and pair.png"]}
    val = labels.check_split([str(root / "images" / "val")], len(NAMES)).to_dict()
    assert val["orphan_labels"]["count"] == 0 and val["shared_labels"]["count"] == 0 and val["labels_found"] == 2

    text = dry_run_output(compose_config(["data=custom", f"data.path={data}", "gpus=0", "dry_run=true"]), tmp_path)
    assert "WARNING: 2 train label file(s) without an image, never read (gone1.txt, gone2.txt)" in text
    assert "WARNING: 1 train label file(s) read by two images or more (pair.txt <- pair.jpg and pair.png)" in text
    assert "val label file" not in text


OBB_ROW = "0 0.2 0.1 0.5 0.3 0.4 0.6 0.1 0.4\n"  # class and four corners


def test_the_check_counts_each_usable_images_row_form_for_the_models_task(tmp_path):
    """Boxes, rotated boxes (every row 9 numbers: class and four corners) and polygons: what model_task.py checks an
    obb or detection model against, also when the verdicts come from the cache."""
    _write(tmp_path, "train", "box.jpg", _jpeg(), GOOD)
    _write(tmp_path, "train", "obb.jpg", _jpeg(), OBB_ROW + OBB_ROW.replace("0 ", "1 ", 1))
    _write(tmp_path, "train", "polygon.jpg", _jpeg(), OBB_ROW + "2 0.1 0.1 0.3 0.1 0.2 0.3\n")
    _write(tmp_path, "train", "empty.jpg", _jpeg(), "")
    _write(tmp_path, "train", "dropped.jpg", _jpeg(), OBB_ROW.replace("0 ", "7 ", 1))
    for _ in range(2):  # the second from the cache
        check = labels.check_split([str(tmp_path / "images" / "train")], len(NAMES), cache_dir=tmp_path / "cache")
        assert check.to_dict()["forms"] == {"boxes": 1, "obb": 1, "polygons": 1} and check.usable == 4
