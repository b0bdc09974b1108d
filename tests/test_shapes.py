"""The built-in synthetic dataset: deterministic, in Ultralytics' layout, labels inside the image."""

from __future__ import annotations

import yaml

from launcher.inputs import shapes


def test_generation_is_deterministic_and_cached(tmp_path):
    spec = shapes.ShapesSpec(train_images=6, val_images=2, width=64, height=48, seed=3)
    data_yaml = shapes.ensure_dataset(tmp_path / "a", spec, workers=1)
    again = shapes.ensure_dataset(tmp_path / "b", spec, workers=2)
    for split, n in (("train", 6), ("val", 2)):
        files = sorted((data_yaml.parent / "images" / split).iterdir())
        assert len(files) == n
        for f in files:
            twin = again.parent / "images" / split / f.name
            assert f.read_bytes() == twin.read_bytes()
    mtime = data_yaml.stat().st_mtime_ns
    assert shapes.ensure_dataset(tmp_path / "a", spec) == data_yaml and data_yaml.stat().st_mtime_ns == mtime


def test_labels_are_valid_yolo_boxes(tmp_path):
    spec = shapes.ShapesSpec(train_images=20, val_images=2, width=96, height=64, max_objects=5)
    data_yaml = shapes.ensure_dataset(tmp_path, spec, workers=1)
    meta = yaml.safe_load(data_yaml.read_text())
    assert meta["names"] == dict(enumerate(shapes.CLASSES))
    rows = [line.split() for f in (data_yaml.parent / "labels" / "train").iterdir() for line in f.read_text().splitlines()]
    assert rows
    for cls, x, y, w, h in rows:
        x, y, w, h = map(float, (x, y, w, h))
        assert int(cls) in range(len(shapes.CLASSES))
        eps = 1e-5  # labels are written with 6 decimals
        assert -eps <= x - w / 2 and x + w / 2 <= 1 + eps and -eps <= y - h / 2 and y + h / 2 <= 1 + eps
