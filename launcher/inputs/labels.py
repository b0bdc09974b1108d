"""Which images of a split Ultralytics will train on, found before any rank starts (no torch, no Ultralytics import).

When a rank builds its dataset, Ultralytics checks every image and label file (ultralytics/data/utils.py,
verify_image_label and check_image, 8.4.190) and drops the pairs that fail with a warning deep in the log. The same
rules run here, so the plan can say how many images each split really has and why the others are out:

* dropped: a file Pillow cannot identify or verify, one smaller than 10 px on a side, a format Ultralytics does not
  read, a truncated JPEG that cannot be decoded (Ultralytics rewrites one whose end marker alone is missing), and
  any label problem: a class id >= nc, coordinates above 1.01 or below 0 (1 % tolerance), a non-integer class,
  rows that are not 5 numbers, segment and box rows mixed. One bad line drops the whole image.
* kept: an image without a label file or with an empty one (a background image), duplicate label rows (removed).
* counted, per usable image, the form of its rows (`forms`): boxes (class x y w h), obb (every row class and four
  corners: Ultralytics' rotated-box labels) or polygons; what a model's task needs of them is model_task.py's.
* noted, as Ultralytics says nothing of them: label files whose image is gone (it never reads them), and images that
  share one label file (a.jpg and a.png both read a.txt).

Only the label files (small) and each image's header are read (a JPEG whose end marker is missing is decoded, as
Ultralytics decodes it). Verdicts are cached under paths.cache keyed by every file's size and mtime, like
Ultralytics' labels.cache: a second plan of the same data only stats the files, which keeps planning a
million-image split in seconds after its first scan (every image checked, not a sample: a sample cannot say which
file to fix). The first scan runs on threads (file reads release the GIL).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# ultralytics/data/utils.py IMG_FORMATS (8.4.190): the suffixes its dataset lister keeps
IMG_FORMATS = {"avif", "bmp", "dng", "heic", "heif", "jp2", "jpeg", "jpg", "mpo", "png", "tif", "tiff", "webp"}
RULES = "ultralytics 8.4.190 verify_image_label, detect task; ddp-launch check 3"  # in the cache key
EXAMPLES = 3  # file names shown per reason
THREADS = min(16, os.cpu_count() or 1)
CHUNK = 256  # at most this many files per task of the check's thread pool
BOX_ROWS, OBB_ROWS, POLYGON_ROWS = FORMS = ("boxes", "obb", "polygons")  # the forms of an image's label rows
OBB_COLUMNS = 9  # an obb row: class and four corners' x, y

UNIDENTIFIED = "not an image Pillow can read (random bytes, or an unsupported format)"
TOO_SMALL = "smaller than 10 px on a side"
TRUNCATED = "truncated JPEG that cannot be decoded"
BACKGROUND_MISSING = "no label file (trained as background)"
BACKGROUND_EMPTY = "empty label file (trained as background)"
DUPLICATES = "duplicate label rows removed"
RESTORED = "JPEG without its end marker (Ultralytics rewrites the file when it scans it)"


def list_images(entries: list[str]) -> list[str]:
    """The images of a split as Ultralytics' BaseDataset.get_img_files lists them: every file of a folder
    (recursively, as glob's '**/*.*' finds them: hidden files and folders left out, linked folders followed), or the
    lines of a .txt list ('./' relative to it); by suffix, sorted."""
    files: list[str] = []
    for entry in entries:
        p = Path(entry)
        if p.is_dir():
            files += _files_under(str(p))
        elif p.is_file():
            parent = str(p.parent) + os.sep
            lines = p.read_text(encoding="utf-8-sig").strip().splitlines()
            files += [x.replace("./", parent, 1) if x.startswith("./") else x for x in lines]
    return sorted(f for f in files if f.rpartition(".")[-1].lower() in IMG_FORMATS)


def _files_under(root: str) -> list[str]:
    """Every file below `root` whose name has a dot, hidden names left out, as glob lists them. os.scandir's entries
    know their type without a stat per file (a split of a million images is listed in seconds on a slow file
    system); a linked folder is followed unless it leads back to a folder it is in (glob would loop)."""
    found: list[str] = []
    folders = [(root, frozenset([_folder_id(root)]))]
    while folders:
        folder, above = folders.pop()
        try:
            with os.scandir(folder) as entries:
                for e in entries:
                    if e.name.startswith("."):
                        continue
                    try:
                        if e.is_dir():
                            inside = _folder_id(e.path)
                            if inside not in above:
                                folders.append((e.path, above | {inside}))
                        elif "." in e.name and e.is_file():
                            found.append(e.path)
                    except OSError:  # a link that points nowhere, a file gone meanwhile
                        continue
        except OSError:
            continue
    return found


def _folder_id(folder: str) -> tuple[int, int]:
    st = os.stat(folder)
    return st.st_dev, st.st_ino


def label_file(image: str) -> str:
    """Ultralytics' img2label_paths: the last /images/ of the path becomes /labels/, the suffix .txt."""
    sa, sb = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    return sb.join(image.rsplit(sa, 1)).rsplit(".", 1)[0] + ".txt"


@dataclass
class SplitCheck:
    images: int = 0  # listed
    usable: int = 0  # what the ranks train or validate on
    labels_found: int = 0  # label files read by the split's images (one shared by two images counts once)
    dropped: dict[str, list[str]] = field(default_factory=dict)  # reason -> files
    kept: dict[str, list[str]] = field(default_factory=dict)  # worth knowing: background images, duplicates, ...
    most_boxes: int = 0  # the most boxes in one usable image (what a batch's padded targets must hold)
    forms: dict[str, int] = field(default_factory=dict)  # usable labelled images per row form (FORMS)
    orphan_labels: list[str] = field(default_factory=list)  # label files beside the split's whose image is gone
    shared_labels: dict[str, list[str]] = field(default_factory=dict)  # a label file -> the images that read it

    def to_dict(self) -> dict:
        """The split as the plan, summary.json and the final lines give it: counts, and the first files per reason."""
        def counted(d):
            return {reason: {"count": len(files), "first": [Path(f).name for f in files[:EXAMPLES]]}
                    for reason, files in sorted(d.items(), key=lambda kv: -len(kv[1]))}
        shared = sorted(self.shared_labels.items())
        return {"images": self.images, "usable": self.usable, "labels_found": self.labels_found,
                "dropped": counted(self.dropped), "kept": counted(self.kept), "most_boxes": self.most_boxes,
                "forms": dict(sorted(self.forms.items())),
                "orphan_labels": {"count": len(self.orphan_labels),
                                  "first": [Path(f).name for f in self.orphan_labels[:EXAMPLES]]},
                "shared_labels": {"count": len(shared), "first": [
                    f"{Path(label).name} <- {' and '.join(Path(i).name for i in images)}"
                    for label, images in shared[:EXAMPLES]]}}


def describe(split: str, check: dict) -> list[str]:
    """Lines for a split's dropped and notable images ('5 of 24 train images dropped: 2 class id >= nc (a.jpg,
    b.jpg); ...'); none for a clean split."""
    def listed(reasons: dict) -> str:
        return "; ".join(f"{r['count']} {reason} ({', '.join(r['first'])}{', ...' if r['count'] > len(r['first']) else ''})"
                         for reason, r in reasons.items())

    def more(r: dict) -> str:
        return ", ..." if r["count"] > len(r["first"]) else ""

    dropped = sum(r["count"] for r in check["dropped"].values())
    lines = [f"{dropped} of {check['images']} {split} images dropped: {listed(check['dropped'])}"] if dropped else []
    if check["kept"]:
        lines.append(f"{split} images kept: {listed(check['kept'])}")
    orphans, shared = check.get("orphan_labels") or {"count": 0}, check.get("shared_labels") or {"count": 0}
    if orphans["count"]:
        lines.append(f"WARNING: {orphans['count']} {split} label file(s) without an image, never read "
                     f"({', '.join(orphans['first'])}{more(orphans)}): their images are gone; put them back or delete "
                     "the label files")
    if shared["count"]:
        lines.append(f"WARNING: {shared['count']} {split} label file(s) read by two images or more "
                     f"({'; '.join(shared['first'])}{more(shared)}): each image trains on the same boxes; give each "
                     "image its own name")
    return lines


# --- one image and its labels ---------------------------------------------------------------------------------------
def check_pair(image: str, labels: str, nc: int, nkpt: int = 0,
               ndim: int = 0) -> tuple[str | None, str | None, int, str | None]:
    """(why the pair is dropped or None, a note on a kept pair or None, the boxes a kept pair trains on, the form of
    its rows: one of FORMS, None without rows): Ultralytics' verify_image_label for the detect task, without
    writing anything."""
    reason, note, boxes, form = _verdict(image, labels, nc, nkpt, ndim)
    return (reason, note, 0, None) if reason else (reason, note, boxes, form if boxes else None)


def _verdict(image: str, labels: str, nc: int, nkpt: int, ndim: int) -> tuple[str | None, str | None, int, str | None]:
    try:
        note = _check_image(image)
    except _Dropped as e:
        return str(e), None, 0, None
    if not os.path.isfile(labels):
        return None, note or BACKGROUND_MISSING, 0, None
    try:
        with open(labels, encoding="utf-8-sig") as f:
            rows = [x.split() for x in f.read().strip().splitlines() if x.strip()]
    except (OSError, UnicodeDecodeError) as e:
        return f"unreadable label file ({type(e).__name__})", None, 0, None
    if nkpt:  # pose labels for a box task: the box is kept, the keypoints dropped
        rows = [x[:5] if len(x) == 5 + nkpt * ndim else x for x in rows]
    form = BOX_ROWS
    try:
        if any(len(x) > 6 for x in rows):  # polygons: their boxes
            if any(len(x) == 5 for x in rows):
                return "labels mix segment and box rows", None, 0, None
            form = OBB_ROWS if all(len(x) == OBB_COLUMNS for x in rows) else POLYGON_ROWS
            classes = np.array([x[0] for x in rows], dtype=np.float32)
            boxes = []
            for x in rows:
                xy = np.array(x[1:], dtype=np.float32).reshape(-1, 2)
                (x0, y0), (x1, y1) = xy.min(0), xy.max(0)
                boxes.append([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0])
            lb = np.concatenate((classes.reshape(-1, 1), np.array(boxes, dtype=np.float32).reshape(-1, 4)), 1)
        else:
            lb = np.array(rows, dtype=np.float32)
    except ValueError:
        return "label rows that are not numbers of one length", None, 0, None
    if not len(lb):
        return None, note or BACKGROUND_EMPTY, 0, None
    if lb.ndim != 2 or lb.shape[1] != 5:
        return "label rows that are not 5 numbers (class x y w h)", None, 0, None
    if not lb[:, 1:].max() <= 1.01:  # written as Ultralytics asserts it: a NaN fails too
        return "label coordinates above 1 (not normalised to the image size)", None, 0, None
    if not (lb.min() >= 0 or (lb.min() >= -0.01 and lb[:, 3:5].min() >= 0)):
        return "negative label values", None, 0, None
    if not (lb[:, 0] % 1 == 0).all():
        return "non-integer class ids", None, 0, None
    if not lb[:, 0].max() < nc:
        return f"class id >= nc ({nc} classes: 0-{nc - 1})", None, 0, None
    unique = len(np.unique(lb, axis=0))
    return None, (note or DUPLICATES) if unique < len(lb) else note, unique, form


class _Dropped(Exception):
    pass


def _check_image(image: str) -> str | None:
    """Ultralytics' check_image without its write: None, or RESTORED for a JPEG it rewrites; _Dropped otherwise."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        im = Image.open(image)
    except (UnidentifiedImageError, ImportError):  # ImportError: Ultralytics' Image.open patch, when it is loaded
        if not _heif_registered(image):
            raise _Dropped(UNIDENTIFIED) from None
        try:
            im = Image.open(image)
        except (UnidentifiedImageError, ImportError):
            raise _Dropped(UNIDENTIFIED) from None
    except OSError as e:
        raise _Dropped(f"unreadable image ({e.strerror or e})") from None
    try:
        im.verify()
    except Exception as e:  # Pillow raises what the format's plugin raises
        raise _Dropped(f"corrupt image ({type(e).__name__}: {e})") from None
    w, h = _exif_size(im)
    if w <= 9 or h <= 9:
        raise _Dropped(TOO_SMALL)
    fmt = (im.format or "").lower()
    if fmt not in IMG_FORMATS | {"jpeg2000"}:
        raise _Dropped(f"format {im.format} that Ultralytics does not read")
    if fmt in ("jpg", "jpeg"):
        with open(image, "rb") as f:
            f.seek(-2, 2)
            if f.read() == b"\xff\xd9":
                return None
        try:  # Ultralytics decodes it to write it again: a truncated one fails there
            with Image.open(image) as again:
                ImageOps.exif_transpose(again).load()
        except Exception:
            raise _Dropped(TRUNCATED) from None
        return RESTORED
    return None


def _exif_size(im) -> tuple[int, int]:
    """Ultralytics' exif_size: (w, h) with an EXIF rotation of 90 or 270 degrees applied."""
    w, h = im.size
    try:
        exif = im.tag_v2 if im.format == "TIFF" else im.getexif()
        if exif.get(274) in {5, 6, 7, 8}:
            return h, w
    except Exception:
        pass
    return w, h


def _heif_registered(image: str) -> bool:
    """Ultralytics retries a file Pillow cannot identify with pi-heif's HEIF opener; so does this, when installed."""
    import importlib.util

    if not image.lower().endswith((".heic", ".heif", ".avif")) or importlib.util.find_spec("pi_heif") is None:
        return False
    from pi_heif import register_heif_opener

    register_heif_opener()
    return True


# --- a split, with its verdicts cached -------------------------------------------------------------------------------
def _stamp(path: str) -> list[int]:
    try:
        st = os.stat(path)
    except OSError:
        return [-1, -1]
    return [st.st_size, st.st_mtime_ns]


def check_split(entries: list[str], nc: int, *, kpt_shape=None, cache_dir: Path | None = None,
                write_cache: bool = True) -> SplitCheck:
    """Every image of a split checked as Ultralytics checks it; verdicts of unchanged files read from the cache."""
    images = list_images(entries)
    nkpt, ndim = (kpt_shape or (0, 0))[:2]
    key = hashlib.sha256(json.dumps([RULES, sorted(entries), nc, nkpt, ndim]).encode()).hexdigest()[:24]
    cache_file = Path(cache_dir) / f"labels-{key}.json" if cache_dir else None
    cached = _read_cache(cache_file)
    stamps = {}

    def verdict(image: str):
        labels = label_file(image)
        stamp = _stamp(image) + _stamp(labels)
        stamps[image] = stamp
        hit = cached.get(image)
        if hit is not None and hit[:4] == stamp:
            return tuple(hit[4:8])
        return check_pair(image, labels, nc, nkpt, ndim)

    # in chunks: a future per file cost more than the file's stat on a repeated plan (the verdicts cached); enough of
    # them that every thread reads headers on a first scan
    size = max(16, min(CHUNK, -(-len(images) // (4 * THREADS))))
    chunks = [images[i : i + size] for i in range(0, len(images), size)]
    pool = ThreadPoolExecutor(THREADS)
    try:
        verdicts = [v for chunk in pool.map(lambda c: [verdict(im) for im in c], chunks) for v in chunk]
    finally:  # Ctrl-C: the chunks not started are dropped, not checked before the launcher can stop
        pool.shutdown(wait=False, cancel_futures=True)
    result = SplitCheck(images=len(images))
    readers: dict[str, list[str]] = {}  # label file -> the images that read it
    for image in images:
        readers.setdefault(label_file(image), []).append(image)
    result.labels_found = sum(1 for image in images if stamps[image][2] >= 0 and readers[label_file(image)][0] == image)
    result.shared_labels = {label: found for label, found in readers.items()
                            if len(found) > 1 and stamps[found[0]][2] >= 0}
    result.orphan_labels = [f for f in _label_files(entries) if f not in readers]
    for image, (dropped, note, boxes, form) in zip(images, verdicts):
        if dropped:
            result.dropped.setdefault(dropped, []).append(image)
            continue
        result.usable += 1
        result.most_boxes = max(result.most_boxes, boxes)
        if form:
            result.forms[form] = result.forms.get(form, 0) + 1
        if note:
            result.kept.setdefault(note, []).append(image)
    fresh = {im: stamps[im] + list(v) for im, v in zip(images, verdicts)}
    if cache_file is not None and write_cache and fresh != cached:
        _write_cache(cache_file, fresh)
    return result


def _label_files(entries: list[str]) -> list[str]:
    """The label files where Ultralytics looks for a split's labels: below each image folder's labels/ twin (the
    folder itself, where the path holds no images/), sorted. A split given as a .txt list of images has no folder."""
    found: set[str] = set()
    for entry in entries:
        if os.path.isdir(entry):
            folder = os.path.dirname(label_file(os.path.join(entry, "x.jpg")))
            if os.path.isdir(folder):
                found.update(f for f in _files_under(folder) if f.endswith(".txt"))
    return sorted(found)


def _read_cache(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
        return data["files"] if data.get("rules") == RULES else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # absent or damaged: checked again


def _write_cache(path: Path, files: dict) -> None:
    """Best effort (a read-only cache folder only costs the next plan a scan): a temporary file renamed into place."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"rules": RULES, "files": files}))
        os.replace(tmp, path)
    except OSError:
        pass
