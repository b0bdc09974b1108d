"""The built-in synthetic dataset: filled circles, squares and triangles on noisy or textured backgrounds, labelled
for the task the model trains (`task`): boxes, polygons (segment), four keypoints per shape (pose: its top, right,
bottom and left points, kpt_shape [4, 3], flip_idx swapping right and left) or rotated boxes (obb: each shape
stretched and turned, an ellipse, a rectangle or a triangle filling a rotated rectangle, labelled by its corners).
For classification (classify) each image holds one large shape, its class the shape's and its colour the class's
hue, in class folders: <root>/shapes-<digest>/{train,val}/<class>/*.jpg (inputs/class_folders.py).

Generated once per distinct setting into `<root>/shapes-<digest>/` in Ultralytics' layout (images/{train,val},
labels/{train,val}, data.yaml), fully determined by the settings and the seed, and shared by every later run.
Shapes are large, solid and of distinct colours, so a YOLO trained from scratch on a CPU reaches a clearly non-zero
mAP in minutes. With `texture=true` and 640x480 it stands in for photos in the throughput benchmarks (JPEG decode
and augmentation cost like real images).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import yaml

from launcher.inputs import class_folders

CLASSES = ("circle", "square", "triangle")
TASKS = ("detect", "segment", "pose", "obb", "classify")
CLASS_COLOURS = ((60, 60, 210), (60, 190, 60), (210, 90, 40))  # classify: each class's BGR hue (red, green, blue)
KPT_SHAPE, FLIP_IDX = [4, 3], [0, 3, 2, 1]  # top, right, bottom, left: a horizontal flip swaps right and left
CIRCLE_VERTICES = 24  # a circle's polygon
MARKER = "data.yaml"  # written last: its presence means the folder is complete


@dataclass(frozen=True)
class ShapesSpec:
    train_images: int = 256
    val_images: int = 64
    width: int = 160
    height: int = 160
    min_objects: int = 1
    max_objects: int = 4
    texture: bool = False
    quality: int = 90
    seed: int = 0
    task: str = "detect"

    @classmethod
    def from_config(cls, synthetic: dict) -> ShapesSpec:
        return cls(**{k: synthetic[k] for k in cls.__dataclass_fields__ if k in synthetic})

    def digest(self) -> str:
        fields = asdict(self)
        if self.task == "detect":  # the boxes' datasets keep the folder they were generated in
            fields.pop("task")
        blob = json.dumps({"v": 1, **fields}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def problems(self) -> list[str]:
        out = []
        if self.train_images < 1 or self.val_images < 1:
            out.append("data.synthetic.train_images and val_images must be >= 1")
        if min(self.width, self.height) < 32:
            out.append("data.synthetic.width and height must be >= 32 pixels")
        if not 1 <= self.min_objects <= self.max_objects:
            out.append("data.synthetic: need 1 <= min_objects <= max_objects")
        if not 1 <= self.quality <= 100:
            out.append("data.synthetic.quality is a JPEG quality, 1..100")
        if self.task not in TASKS:
            out.append(f"data.synthetic.task={self.task!r}: expected auto (the model's task), {', '.join(TASKS)}")
        return out


def dataset_dir(root: Path, spec: ShapesSpec) -> Path:
    return Path(root) / f"shapes-{spec.digest()}"


def _background(rng: np.random.Generator, h: int, w: int, texture: bool) -> np.ndarray:
    base = rng.integers(40, 216, size=3)
    img = np.empty((h, w, 3), np.float32)
    img[:] = base
    if texture:
        import cv2

        # Low-frequency colour blotches plus fine grain: compresses like a photo, not like a flat card.
        coarse = rng.normal(0, 40, size=(max(h // 32, 2), max(w // 32, 2), 3)).astype(np.float32)
        img += cv2.resize(coarse, (w, h), interpolation=cv2.INTER_CUBIC)
        for _ in range(int(rng.integers(3, 8))):
            p1 = tuple(int(v) for v in (rng.integers(0, w), rng.integers(0, h)))
            p2 = tuple(int(v) for v in (rng.integers(0, w), rng.integers(0, h)))
            color = tuple(int(c) for c in rng.integers(0, 256, size=3))
            cv2.line(img, p1, p2, color, int(rng.integers(1, 4)))
        img += rng.normal(0, 12, size=img.shape).astype(np.float32)
    else:
        img += rng.normal(0, 10, size=img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def _draw_image(spec: ShapesSpec, split: str, index: int) -> tuple[np.ndarray, list[tuple[float, ...]]]:
    """One image and its YOLO label rows for spec.task (class, then the box cx, cy, w, h; or the polygon's x, y
    pairs; or the box and four keypoints' x, y, visible; or the rotated box's four corners; normalised), a pure
    function of (spec, split, index)."""
    import cv2

    seed = int.from_bytes(hashlib.sha256(f"{spec.seed}/{split}/{index}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    h, w = spec.height, spec.width
    img = _background(rng, h, w, spec.texture)
    labels = []
    placed: list[tuple[int, int, int, int]] = []
    classify = spec.task == "classify"  # one large shape of the class `index` picks, in its class's colour
    n = 1 if classify else int(rng.integers(spec.min_objects, spec.max_objects + 1))
    short = min(h, w)
    for _ in range(n):
        for _attempt in range(20):  # avoid heavy overlap so every label stays visible
            size = int(rng.uniform(*((0.45, 0.8) if classify else (0.15, 0.35))) * short)
            x0 = int(rng.integers(0, w - size))
            y0 = int(rng.integers(0, h - size))
            box = (x0, y0, x0 + size, y0 + size)
            if all(_iou(box, other) < 0.1 for other in placed):
                break
        else:
            continue
        placed.append(box)
        cls = index % len(CLASSES) if classify else int(rng.integers(0, len(CLASSES)))
        color = tuple(int(c) for c in (np.clip(np.array(CLASS_COLOURS[cls]) + rng.integers(-40, 41, size=3), 0, 255)
                                       if classify else rng.integers(0, 256, size=3)))
        x0, y0, x1, y1 = box
        if spec.task == "obb":
            corners = _rotated_shape(img, CLASSES[cls], (x0 + x1) / 2, (y0 + y1) / 2, size, rng, color)
            labels.append((cls, *np.clip(corners / (w, h), 0, 1).ravel().tolist()))
            continue
        cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
        if CLASSES[cls] == "circle":
            cv2.circle(img, (cx, cy), size // 2, color, -1, lineType=cv2.LINE_AA)
            angles = np.linspace(0, 2 * np.pi, CIRCLE_VERTICES, endpoint=False)
            polygon = np.stack([cx + size / 2 * np.cos(angles), cy + size / 2 * np.sin(angles)], 1)
            points = [(cx, y0), (x1, cy), (cx, y1), (x0, cy)]
        elif CLASSES[cls] == "square":
            cv2.rectangle(img, (x0, y0), (x1 - 1, y1 - 1), color, -1)
            polygon = np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], np.float64)
            points = [(cx, y0), (x1, cy), (cx, y1), (x0, cy)]
        else:
            pts = np.array([[cx, y0], [x0, y1 - 1], [x1 - 1, y1 - 1]], np.int32)
            cv2.fillPoly(img, [pts], color, lineType=cv2.LINE_AA)
            polygon = pts.astype(np.float64)
            points = [(cx, y0), (x1 - 1, y1 - 1), (cx, y1 - 1), (x0, y1 - 1)]
        box_row = ((x0 + x1) / 2 / w, (y0 + y1) / 2 / h, size / w, size / h)
        if classify:
            labels.append((cls,))
        elif spec.task == "segment":
            xy = np.clip(polygon / (w, h), 0, 1)
            labels.append((cls, *xy.ravel().tolist()))
        elif spec.task == "pose":
            labels.append((cls, *box_row, *(v for x, y in points for v in (min(x / w, 1.0), min(y / h, 1.0), 2))))
        else:
            labels.append((cls, *box_row))
    return img, labels


def _rotated_shape(img: np.ndarray, name: str, cx: float, cy: float, size: int, rng: np.random.Generator,
                   color: tuple) -> np.ndarray:
    """Draw `name` filling a rectangle of 1.6 to 2.5 to 1, turned by a random angle and as large as fits the
    size x size square at (cx, cy); return the rectangle's four corners (4, 2) in pixels, in order around it."""
    import cv2

    angle, ratio = rng.uniform(0, np.pi), rng.uniform(0.4, 0.625)
    c, s = abs(np.cos(angle)), abs(np.sin(angle))
    long = size / max(c + ratio * s, s + ratio * c)  # the turned rectangle's upright extent is `size` at most
    u = np.array([np.cos(angle), np.sin(angle)]) * long / 2  # half the long side, along it
    v = np.array([-np.sin(angle), np.cos(angle)]) * long * ratio / 2  # half the short side
    centre = np.array([cx, cy])
    corners = np.stack([centre - u - v, centre + u - v, centre + u + v, centre - u + v])
    if name == "circle":
        axes = (int(round(long / 2)), int(round(long * ratio / 2)))
        cv2.ellipse(img, (int(round(cx)), int(round(cy))), axes, float(np.degrees(angle)), 0, 360, color, -1,
                    lineType=cv2.LINE_AA)
    elif name == "square":
        cv2.fillPoly(img, [np.round(corners).astype(np.int32)], color, lineType=cv2.LINE_AA)
    else:  # the apex at one short side's middle, the base along the other
        triangle = np.stack([centre - u, centre + u - v, centre + u + v])
        cv2.fillPoly(img, [np.round(triangle).astype(np.int32)], color, lineType=cv2.LINE_AA)
    return corners


def _iou(a, b) -> float:
    ix = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union else 0.0


def _write_chunk(args: tuple[ShapesSpec, str, str, range]) -> None:
    import cv2

    spec, folder, split, indices = args
    folder = Path(folder)
    for i in indices:
        img, labels = _draw_image(spec, split, i)
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, spec.quality])
        if not ok:
            raise RuntimeError(f"JPEG encoding failed for {split} image {i}")
        if spec.task == "classify":  # the class folder is the label
            (folder / split / CLASSES[labels[0][0]] / f"{i:06d}.jpg").write_bytes(buf.tobytes())
            continue
        (folder / "images" / split / f"{i:06d}.jpg").write_bytes(buf.tobytes())
        (folder / "labels" / split / f"{i:06d}.txt").write_text(
            "".join(f"{row[0]} " + " ".join(f"{v:.6f}" if isinstance(v, float) else str(v) for v in row[1:]) + "\n"
                    for row in labels)
        )


def class_folders_spec(folder: Path) -> dict:
    """The classify dataset's data YAML (class_folders.py's form): its splits are class folders."""
    return {"path": str(folder), "train": str(folder / "train"), "val": str(folder / "val"),
            "names": dict(enumerate(CLASSES)), "nc": len(CLASSES), "channels": 3, class_folders.MARK: True}


def data_yaml_text(folder: Path, task: str = "detect") -> str:
    if task == "classify":
        return yaml.safe_dump(class_folders_spec(folder), sort_keys=False)
    names = "\n".join(f"  {i}: {n}" for i, n in enumerate(CLASSES))
    keypoints = f"kpt_shape: {KPT_SHAPE}\nflip_idx: {FLIP_IDX}\n" if task == "pose" else ""
    return f"path: {folder}\ntrain: images/train\nval: images/val\n{keypoints}names:\n{names}\n"


def ensure_dataset(root: Path, spec: ShapesSpec, workers: int | None = None, log=print) -> Path:
    """Generate the dataset unless it exists; return its data.yaml. Safe when several launches race."""
    final = dataset_dir(root, spec)
    if (final / MARKER).is_file():
        return final / MARKER
    Path(root).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        for split in ("train", "val"):
            for sub in ([f"{split}/{c}" for c in CLASSES] if spec.task == "classify"
                        else [f"images/{split}", f"labels/{split}"]):
                (tmp / sub).mkdir(parents=True)
        total = spec.train_images + spec.val_images
        log(f"Generating the synthetic shapes dataset ({total} images, {spec.width}x{spec.height}) in {final}")
        jobs = []
        chunk = 64
        for split, count in (("train", spec.train_images), ("val", spec.val_images)):
            jobs += [(spec, str(tmp), split, range(s, min(s + chunk, count))) for s in range(0, count, chunk)]
        workers = workers or min(len(jobs), os.cpu_count() or 1)
        if workers > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(workers) as pool:
                list(pool.map(_write_chunk, jobs))
        else:
            for job in jobs:
                _write_chunk(job)
        (tmp / "spec.json").write_text(json.dumps(asdict(spec), indent=2))
        (tmp / MARKER).write_text(data_yaml_text(final, spec.task))
        try:
            os.rename(tmp, final)  # atomic publish; fails if a concurrent launch published first
        except OSError:
            if not (final / MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final / MARKER
