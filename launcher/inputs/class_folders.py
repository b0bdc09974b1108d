"""A classification dataset: a folder of class folders, as Ultralytics' `data=path/to/folder` reads it
(check_cls_dataset, ClassificationDataset), checked before any rank starts.

    root/train/<class>/*.jpg      the training split: one folder per class, its name the class's
    root/val/<class>/*.jpg        the validation split (or validation/, valid/, test/, in Ultralytics' order)

The classes are the training split's folders, sorted by name (Ultralytics' names); a validation folder of a class the
training split lacks would be skipped by Ultralytics (its images never scored), so it is refused here, as are a
missing split and a split without images. The data YAML the ranks get (`spec`) names the splits and the classes and
carries `class_folders: true`, which is how the run folder's data.yaml says it holds class folders, not labels.
"""

from __future__ import annotations

from pathlib import Path

from launcher.inputs import labels

MARK = "class_folders"  # the data YAML key that says the splits are class folders (a classification dataset)
VAL_FOLDERS = ("val", "validation", "valid", "test")  # check_cls_dataset's validation split, first found
LAYOUT = "root/train/<class>/*.jpg and root/val/<class>/*.jpg"


def is_class_folders(spec: dict | None) -> bool:
    """Whether the data YAML `spec` is a classification dataset's (class folders, no label files)."""
    return bool((spec or {}).get(MARK))


def _images(folder: Path) -> dict[str, int]:
    """Per class folder of `folder`, its images (Ultralytics' image suffixes, at any depth below it)."""
    counts = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        counts[sub.name] = sum(1 for f in sub.rglob("*.*") if f.suffix[1:].lower() in labels.IMG_FORMATS)
    return counts


def _check(counts: dict[str, int]) -> dict:
    """A split's counts as the plan, summary.json and the final lines give every split (labels.SplitCheck's form:
    each image is its class folder's label)."""
    n = sum(counts.values())
    return labels.SplitCheck(images=n, usable=n, labels_found=n).to_dict()


def read(name: str, root: Path) -> tuple[dict | None, dict, list[str]]:
    """(the data YAML the ranks get, its splits' checks, problems) of the class-folder dataset at `root`; one line
    per problem, saying what to change."""
    root = Path(root).expanduser().resolve()
    where = f"dataset '{name}' ({root})"
    if not root.is_dir():
        return None, {}, [f"{where}: no such folder; put the class folders there ({LAYOUT}) or point data.path at "
                          "the folder that holds them"]
    train = root / "train"
    if not train.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir())
        labelled = " (images/ beside labels/ is a detection layout: give its data YAML, data=path/to/data.yaml)" \
            if {"images", "labels"} <= set(found) else ""
        return None, {}, [f"{where}: no train/ folder (it holds {', '.join(found[:5]) or 'no folders'}); a "
                          f"classification dataset is {LAYOUT}, one folder per class{labelled}"]
    val = next((root / v for v in VAL_FOLDERS if (root / v).is_dir()), None)
    if val is None:
        return None, {}, [f"{where}: no val/ folder (nor validation/, valid/ or test/); put the validation images in "
                          "val/<class>/, one folder per class named as in train/"]
    counts = {"train": _images(train), "val": _images(val)}
    classes = [c for c, n in counts["train"].items() if n]
    problems = []
    if not classes:
        loose = sum(1 for f in train.iterdir() if f.is_file() and f.suffix[1:].lower() in labels.IMG_FORMATS)
        problems.append(f"{where}: no class folder with images under train/"
                        + (f" ({loose} images lie in train/ itself)" if loose else "")
                        + f"; a classification dataset is {LAYOUT}, one folder per class")
    if classes and len(classes) < 2:
        problems.append(f"{where}: train/ has one class ({classes[0]}); a classifier needs two or more class folders")
    empty = [c for c, n in counts["train"].items() if not n]
    if classes and empty:
        problems.append(f"{where}: train/ class folder(s) without images: {', '.join(empty[:5])}; add images or "
                        "remove them (each folder is a class the model would predict)")
    extra = sorted(set(c for c, n in counts["val"].items() if n) - set(classes))
    if classes and extra:
        problems.append(f"{where}: {val.name}/ has class folder(s) train/ lacks: {', '.join(extra[:5])}; name "
                        f"{val.name}/'s folders as train/'s ({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''}) "
                        "or add those classes to train/")
    if classes and not sum(counts["val"].values()):
        problems.append(f"{where}: no images under {val.name}/<class>/; put validation images there, one folder per "
                        "class named as in train/")
    if problems:
        return None, {}, problems
    names = dict(enumerate(sorted(counts["train"])))  # check_cls_dataset's: every train folder, sorted
    spec = {"path": str(root), "train": str(train), "val": str(val), "names": names, "nc": len(names),
            "channels": 3, MARK: True}
    return spec, {split: _check(c) for split, c in counts.items()}, []
