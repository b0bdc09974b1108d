"""The fast validation engine on a whole split: the split read, preloaded and placed on the device (at once or a slice
at a time between steps), the graphs its batches replay, and FastValidator against DetectionValidator on a real
model and data (CPU, fp32: the same pixels and arithmetic, so to 1e-4), its report, plots and loss. The NMS, the
matching and the metrics one at a time: tests/test_fast_validation.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ultralytics.cfg import get_cfg
from ultralytics.models.yolo.detect import DetectionValidator
from ultralytics.nn.tasks import DetectionModel

from launcher.inputs.shapes import CLASSES, ShapesSpec, ensure_dataset
from launcher.rank.group.dist import Comm
from launcher.rank.ultralytics import datasets
from launcher.rank.ultralytics.fast_validation import FastValidator
from launcher.rank.ultralytics.validation import Validator
from launcher.rank.validate.engine import target_boxes
from launcher.rank.validate.store import Placement, PreloadedSplit

from tests.test_fast_validation import NC, _loader_batches


def test_the_preload_keeps_every_image_once_grouped_by_shape_with_its_labels():
    a, b = _loader_batches(5, 2, shape=(64, 96), seed=1), _loader_batches(3, 2, shape=(96, 64), seed=2)
    split = PreloadedSplit.load([a[0], b[0], a[1], b[1], a[2]], torch.device("cpu"))
    assert split.shapes == {(64, 96): 5, (96, 64): 3} and len(split) == 8
    seen = []
    for vb in split.batches(4):
        seen += vb.files
        source = a if vb.img.shape[2:] == (64, 96) else b
        for i, f in enumerate(vb.files):
            k = int(f[2:-4])
            batch, j = source[k // 2], k % 2
            assert torch.equal(vb.img[i], batch["img"][j])
            mine = batch["batch_idx"] == j
            n = int(vb.count[i])
            assert torch.equal(vb.cls[i, :n], batch["cls"][mine, 0]) and torch.equal(vb.xywh[i, :n], batch["bboxes"][mine])
        targets = vb.ultralytics_targets()
        assert targets["cls"].shape[0] == int(vb.count.sum()) == targets["bboxes"].shape[0]
        assert torch.equal(target_boxes(vb, vb.img.shape[2:])[..., 2:] >= target_boxes(vb, vb.img.shape[2:])[..., :2],
                           torch.ones_like(vb.cls, dtype=torch.bool)[..., None].expand(-1, -1, 2))
    assert sorted(seen) == sorted([f"im{i}.jpg" for i in range(5)] + [f"im{i}.jpg" for i in range(3)])


@pytest.fixture(scope="module")
def val_split(tmp_path_factory) -> Path:
    """Odd-sized images (97x71): rect batches with padding, resized from their own size."""
    spec = ShapesSpec(train_images=2, val_images=6, width=97, height=71, seed=3)
    return ensure_dataset(tmp_path_factory.mktemp("val"), spec, workers=1, log=lambda *_: None).parent


def a_model_that_finds_objects() -> DetectionModel:
    """yolov8n whose head finds some of the shapes without training: boxes the size of the objects around every
    anchor (a random net's are anywhere) and scores spread over (0, 1) (a fresh head's are all about 1e-3: ties)."""
    torch.manual_seed(0)
    model = DetectionModel("yolov8n.yaml", nc=NC, verbose=False)
    model.args = get_cfg()
    model.names = dict(enumerate(CLASSES))
    finding_boxes(model.model[-1])
    return model


def finding_boxes(head) -> None:
    """A detection head (any task's) set to find some shapes without training: its boxes each side one stride from
    the anchor (a random net's are anywhere), its class scores spread over (0, 1) (a fresh head's are all about
    1e-3: ties). The seed is the caller's."""
    with torch.no_grad():
        for level in head.cv2:
            level[-1].weight.zero_()
            level[-1].bias.copy_(torch.tensor([0.0, 8.0] + [0.0] * 14).repeat(4))  # DFL's bins: about 1 stride
        for level in head.cv3:
            level[-1].bias.zero_()
            level[-1].weight.normal_(0, 2.0)


@pytest.mark.parametrize("folded", [False, True])
def test_the_fast_validator_gives_what_detection_validator_gives_on_a_real_model(val_split, tmp_path, monkeypatch,
                                                                                folded):
    """The same weights and split through both engines: metrics, validation losses and (plots on) the confusion
    matrix equal (CPU, fp32), with the EMA itself or its folded copy. Nothing is drawn: Ultralytics' drawing is
    stubbed out, the fast one never called."""
    from ultralytics.utils import metrics

    for owner, name in [(DetectionValidator, "plot_val_samples"), (DetectionValidator, "plot_predictions"),
                        (metrics.ConfusionMatrix, "plot"), (metrics, "plot_pr_curve"), (metrics, "plot_mc_curve")]:
        monkeypatch.setattr(owner, name, lambda *args, **kwargs: None)
    ema = SimpleNamespace(ema=a_model_that_finds_objects())
    hyp = get_cfg(overrides={"imgsz": 64, "plots": False})
    data = {"val": str(val_split / "images" / "val"), "names": dict(enumerate(CLASSES)), "nc": NC, "channels": 3}
    loaders = [datasets.val_loader(hyp, data, 4, 32, 0, torch.device("cpu")) for _ in range(2)]
    kwargs = dict(device=torch.device("cpu"), data=data, amp=False, epoch=0, epochs=1,
                  loss_items={k: torch.zeros(()) for k in ("box_loss", "cls_loss", "dfl_loss")})
    ref = Validator(loaders[0], hyp, tmp_path / "a")
    want, want_fitness = ref.validate(ema, Comm(), **kwargs, plots=True)
    fast = FastValidator(loaders[1], hyp, tmp_path / "b", batch=4, amp_dtype=None, cuda_graphs=False, folded=folded,
                         log=print)
    got, got_fitness = fast.validate(ema, Comm(), **kwargs, plots=True, draw=lambda what, drawing: None)
    matrix = fast.validator.confusion_matrix.matrix.copy()
    again, _ = fast.validate(ema, Comm(), **kwargs)  # from the preloaded split, without plots
    assert np.array_equal(matrix, ref.validator.confusion_matrix.matrix) and matrix[:NC, :NC].sum() > 0
    assert list(got) == list(want)
    assert got == pytest.approx(want, abs=1e-4) and got_fitness == pytest.approx(want_fitness, abs=1e-4)
    assert again == got
    assert want["metrics/recall(B)"] > 0  # something was found: the comparison is not of zeros
    print(want, got)


def test_the_first_validation_says_where_its_pass_went_batch_by_batch(val_split, tmp_path):
    """The run's first pass captures graphs and starts kernels that the later ones reuse; its log line splits it by
    batch, so that a slow first validation shows whether one batch or every batch was slow. Said once a run."""
    ema = SimpleNamespace(ema=a_model_that_finds_objects())
    hyp = get_cfg(overrides={"imgsz": 64, "plots": False})
    data = {"val": str(val_split / "images" / "val"), "names": dict(enumerate(CLASSES)), "nc": NC, "channels": 3}
    logged: list[str] = []
    fast = FastValidator(datasets.val_loader(hyp, data, 4, 32, 0, torch.device("cpu")), hyp, tmp_path, batch=4,
                         amp_dtype=None, cuda_graphs=False, log=logged.append)
    kwargs = dict(device=torch.device("cpu"), data=data, amp=False, epoch=0, epochs=1,
                  loss_items={k: torch.zeros(()) for k in ("box_loss", "cls_loss", "dfl_loss")})
    for _ in range(2):
        fast.validate(ema, Comm(), **kwargs)
    lines = [line for line in logged if "batch by batch" in line]
    assert len(lines) == 1, logged
    batches = -(-len(fast.split) // 4)
    figures = lines[0].split(": ", 2)[2].removesuffix(" s to its end").replace(" s, then", ",").split(", ")
    assert len(figures) == batches + 1 and all(float(x) >= 0 for x in figures), lines[0]


def test_a_split_read_ahead_during_training_validates_as_one_read_at_the_first_validation(val_split, tmp_path):
    """FastValidator.read_ahead (after the first step): the loader's workers are running, and a thread reads the
    split into host memory, before any validation; the first validation's metrics are those of a validator that read the split only
    then."""
    ema = SimpleNamespace(ema=a_model_that_finds_objects())
    hyp = get_cfg(overrides={"imgsz": 64, "plots": False})
    data = {"val": str(val_split / "images" / "val"), "names": dict(enumerate(CLASSES)), "nc": NC, "channels": 3}
    kwargs = dict(device=torch.device("cpu"), data=data, amp=False, epoch=0, epochs=1,
                  loss_items={k: torch.zeros(()) for k in ("box_loss", "cls_loss", "dfl_loss")})
    ahead, late = (FastValidator(datasets.val_loader(hyp, data, 2, 32, 2, torch.device("cpu")), hyp, tmp_path / name,
                                 batch=4, amp_dtype=None, cuda_graphs=False, device=torch.device("cpu"), log=print)
                   for name in ("a", "b"))
    ahead.read_ahead()
    workers = ahead.loader.iterator._workers
    assert len(workers) == 2 and all(w.is_alive() for w in workers) and late.loader.iterator is None
    ahead.reading.thread.join(timeout=120)
    groups, _ = ahead.reading.result()
    assert ahead.split is None and sum(len(g.files) for g in groups.values()) == 6  # read before the validation asked
    assert not any(w.is_alive() for w in workers)  # its workers joined by the reading thread, not the validation
    ahead.place_ahead()  # a step's end: what was read is on its way to the device
    assert ahead.placing is not None and ahead.split is None
    got, want = ahead.validate(ema, Comm(), **kwargs), late.validate(ema, Comm(), **kwargs)
    assert got == want and len(ahead.split) == len(late.split) == 6 and ahead.placing is None


def test_reading_the_split_moves_nothing_to_a_device_and_placing_it_keeps_every_image(monkeypatch):
    """PreloadedSplit.read runs on a thread while the training thread may capture a CUDA graph, so it must make no
    device copy or page-locking call (either would invalidate a capture); place then gives what load gives."""
    batches = _loader_batches(5, 2, shape=(64, 96), seed=1)
    want = PreloadedSplit.load(batches, torch.device("cpu"))

    def refused(*args, **kwargs):
        raise AssertionError("a device call while reading the split")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "to", refused)
        m.setattr(torch.Tensor, "pin_memory", refused)
        groups = PreloadedSplit.read(batches)
    got = PreloadedSplit.place(groups, torch.device("cpu"))
    assert got.shapes == want.shapes == {(64, 96): 5}
    for a, b in zip(got.batches(4), want.batches(4)):
        assert a.files == b.files and torch.equal(a.img, b.img) and torch.equal(a.xywh, b.xywh)


def test_which_graph_a_batch_replays_its_shapes_whole_one_then_one_of_its_own_size(monkeypatch):
    """InferenceForward's choice of graph (on CUDA; here with a stand-in capture that records what it was asked
    for): full batches replay a graph of `batch` rows; a shape's short last batch replays the whole graph the first
    time (the first validation captures one graph per shape), then its own, rounded up to a quarter of `batch`; a
    shape whose only batch is short gets its own at once. Each replay computes every row of its graph's input."""
    from launcher.rank.validate import forward as forward_module
    from launcher.rank.validate.forward import InferenceForward

    class Graph:
        def __init__(self, static, out):
            self.static, self.out = static, out

        def replay(self):  # the network stand-in: each image's row sum, over every row of the graph's input
            self.out.copy_(self.static.flatten(1).sum(1))

    captured, replayed = [], []

    def capture(self, key):
        rows, *shape = key
        captured.append(key)
        static, out = torch.zeros((rows, 3, *shape)), torch.zeros(rows)
        graph = Graph(static, out)
        original = graph.replay
        graph.replay = lambda: (replayed.append(rows), original())
        self._captured[key] = (graph, static, (out,), forward_module.pytree.tree_flatten(out)[1], ())

    monkeypatch.setattr(InferenceForward, "_capture", capture)
    fwd = InferenceForward(torch.nn.Identity(), torch.device("cpu"), batch=128, amp_dtype=None, graphs=False)
    fwd.graphs = True  # CUDA's path, with the stand-in capture
    full, short = torch.ones((128, 3, 4, 6), dtype=torch.uint8), torch.full((32, 3, 4, 6), 2, dtype=torch.uint8)
    for _ in range(3):  # three validations of six full batches and a short one
        for img in [full] * 6 + [short]:
            out = fwd(img)
            assert torch.allclose(out[: len(img)], img.flatten(1).float().sum(1) / 255)
    assert captured == [(128, 4, 6), (32, 4, 6)]
    assert replayed == [128] * 7 + [128] * 6 + [32] + [128] * 6 + [32]
    assert [fwd.rows_for(n) for n in (1, 32, 33, 100, 128)] == [32, 32, 64, 128, 128]
    fwd(torch.zeros((40, 3, 8, 8), dtype=torch.uint8))  # another shape, short only: its own graph at once
    assert captured[-1] == (64, 8, 8)


@pytest.mark.parametrize("steps_before", [0, 2, 99])
def test_a_split_placed_a_slice_at_a_time_is_the_split_placed_at_once(steps_before):
    """Placement between training steps: each advance copies at most a slice, in whole images (one at least), shape
    group after shape group; whatever the validation finds left is finished then; the split is the one load gives,
    image for image and label for label. On the CPU through `ahead` (on CUDA the copies run on a side stream)."""
    a, b = _loader_batches(5, 2, shape=(64, 96), seed=1), _loader_batches(3, 2, shape=(96, 64), seed=2)
    batches = [a[0], b[0], a[1], b[1], a[2]]
    want = PreloadedSplit.load(batches, torch.device("cpu"))
    per_image = 3 * 64 * 96
    placing = Placement(PreloadedSplit.read(batches), torch.device("cpu"), slice_bytes=2 * per_image + 1, ahead=True)
    sources = {shape: g.img for shape, g in placing.groups.items()}
    copied = []
    for _ in range(steps_before):
        before = placing.copied
        if placing.advance():
            copied.append(placing.copied - before)
            break
        copied.append(placing.copied - before)
    assert all(0 < c <= 2 * per_image + 1 and c % per_image == 0 for c in copied)
    if steps_before == 99:  # 5 + 3 images of one size, two a slice (a slice may end one group and start the next)
        assert placing.done and placing.slices == len(copied) == 4 and placing.copied == 8 * per_image
    got = placing.finish()
    assert placing.copied == 8 * per_image and got.shapes == want.shapes
    assert all(got.groups[shape].img is not src for shape, src in sources.items())  # copies, not the host tensors
    for x, y in zip(got.batches(3), want.batches(3)):
        assert x.files == y.files and torch.equal(x.img, y.img) and torch.equal(x.cls, y.cls)
        assert torch.equal(x.xywh, y.xywh) and torch.equal(x.count, y.count)


def test_a_split_that_fails_to_read_during_training_fails_the_first_validation_with_its_cause():
    from launcher.rank.validate.split_reader import SplitReader

    def batches():
        yield from ()
        raise OSError("val/images/broken.jpg: Input/output error")

    class Broken:
        def __iter__(self):
            return batches()

    reader = SplitReader(Broken())
    with pytest.raises(RuntimeError, match="reading the validation split during training failed") as raised:
        reader.result()
    assert "broken.jpg" in str(raised.value.__cause__)


def test_the_final_validations_plots_are_drawn_when_the_run_asks_and_from_what_that_validation_saw(val_split,
                                                                                                     tmp_path):
    """plots with `draw` (the training run's plotter): the metrics are those of plotting at once, no file is
    written until the drawing runs, and it draws that validation's curves, matrices and batches even after the
    validator has validated other weights (best.pt's, at the end of a run)."""
    ema = SimpleNamespace(ema=a_model_that_finds_objects())
    hyp = get_cfg(overrides={"imgsz": 64, "plots": False})
    data = {"val": str(val_split / "images" / "val"), "names": dict(enumerate(CLASSES)), "nc": NC, "channels": 3}
    kwargs = dict(device=torch.device("cpu"), data=data, amp=False, epoch=0, epochs=1, plots=True,
                  loss_items={k: torch.zeros(()) for k in ("box_loss", "cls_loss", "dfl_loss")})
    now, later = (FastValidator(datasets.val_loader(hyp, data, 4, 32, 0, torch.device("cpu")), hyp, tmp_path / name,
                                batch=4, amp_dtype=None, cuda_graphs=False, log=print) for name in ("now", "later"))
    queued = []
    want = now.validate(ema, Comm(), **kwargs)
    got = later.validate(ema, Comm(), **kwargs, draw=lambda what, fn: queued.append(fn))
    assert got == want and len(queued) == 1 and not list((tmp_path / "later").glob("*.*"))
    with torch.no_grad():  # other weights validated before the drawing runs: it must not draw those
        for p in ema.ema.parameters():
            p.mul_(0.5)
    later.validate(ema, Comm(), **{**kwargs, "plots": False})
    queued[0]()
    drawn = sorted(p.name for p in (tmp_path / "later").iterdir())
    assert drawn == sorted(p.name for p in (tmp_path / "now").iterdir())
    assert {"BoxPR_curve.png", "confusion_matrix.png", "val_batch0_pred.jpg", "val_batch0_labels.jpg"} <= set(drawn)
    matrix = "confusion_matrix.png"
    assert (tmp_path / "later" / matrix).read_bytes() == (tmp_path / "now" / matrix).read_bytes()


def test_the_validation_loss_is_the_mean_over_the_ranks_that_had_images():
    from launcher.rank.ultralytics.fast_validation import mean_loss

    ranks = [{"box_loss": torch.tensor(1.0), "cls_loss": torch.tensor(3.0)}, {},  # 8 GPUs, 4 batches: empty shards
             {"box_loss": torch.tensor(2.0), "cls_loss": torch.tensor(5.0)}]
    assert {k: float(v) for k, v in mean_loss(ranks).items()} == {"box_loss": 1.5, "cls_loss": 4.0}
    assert mean_loss([{}, {}]) == {}
