"""The batched confusion matrix (rank/validate/confusion.py) against Ultralytics' ConfusionMatrix.process_batch
called image by image: exactly the same counts, on random batches made to be hard (IoUs near the threshold, several
detections on one target, tied confidences, detections on both sides of `conf`, empty images) and on a case worked
out by hand. Releases before 8.4.184 match by another rule, and there the fast validator calls process_batch itself
(rank/ultralytics/releases.py; tests/test_validation_split.py compares its matrix with DetectionValidator's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ultralytics.utils.metrics import ConfusionMatrix

from launcher.rank.ultralytics import releases
from launcher.rank.validate.confusion import confusion_counts
from launcher.rank.validate.nms import Detections

pytestmark = pytest.mark.skipif(not releases.GREEDY_CONFUSION,
                                reason="this Ultralytics matches by IoU, not by confidence: the batched counts are unused")

CONF = 0.25
CONFIDENCES = torch.tensor([0.1, 0.25, 0.3, 0.5, 0.5001, 0.9])  # a few values: ties; 0.25 itself is not kept


def random_batch(b: int, nc: int, seed: int, most_targets: int = 6, most_dets: int = 40):
    """(Detections, targets (cls (B, T), boxes (B, T, 4), count (B,))). Detections are jittered copies of the
    targets (scaled and shifted so their IoU with it lies around 0.45), plus some anywhere; images with no targets,
    no detections, or only detections under CONF are among them."""
    g = torch.Generator().manual_seed(seed)
    t_count = torch.randint(0, most_targets + 1, (b,), generator=g)
    d_count = torch.randint(0, most_dets + 1, (b,), generator=g)
    t_count[0], d_count[1] = 0, 0  # an image without targets, one without detections
    t_count[1] = max(int(t_count[1]), 2)
    xy = torch.rand(b, most_targets, 2, generator=g) * 60  # crowded: targets overlap each other too
    wh = 10 + torch.rand(b, most_targets, 2, generator=g) * 20
    t_boxes = torch.cat([xy, xy + wh], -1)
    duplicate = torch.rand(b, most_targets, generator=g) < 0.25  # a target labelled twice: IoU ties (argmax's first)
    duplicate[:, 0] = False
    t_boxes = torch.where(duplicate[..., None], t_boxes.roll(1, 1), t_boxes)
    t_cls = torch.randint(0, nc, (b, most_targets), generator=g).float()

    which = torch.randint(0, most_targets, (b, most_dets), generator=g)
    which = torch.minimum(which, (t_count - 1).clamp(min=0)[:, None])  # a copy of one of the image's targets
    base = t_boxes.gather(1, which[..., None].expand(-1, -1, 4))
    centre, size = (base[..., :2] + base[..., 2:]) / 2, base[..., 2:] - base[..., :2]
    size = size * (0.6 + 0.5 * torch.rand(b, most_dets, 1, generator=g))  # IoU ~ scale^2 when centred: 0.36..1
    centre = centre + (torch.rand(b, most_dets, 2, generator=g) - 0.5) * size * 0.4
    d_boxes = torch.cat([centre - size / 2, centre + size / 2], -1)
    anywhere = torch.rand(b, most_dets, generator=g) < 0.2
    xy = torch.rand(b, most_dets, 2, generator=g) * 80
    d_boxes = torch.where(anywhere[..., None], torch.cat([xy, xy + 15], -1), d_boxes)
    d_boxes = d_boxes.round(decimals=1)  # shared coordinates: some equal IoUs (argmax ties)
    conf = CONFIDENCES[torch.randint(0, len(CONFIDENCES), (b, most_dets), generator=g)]
    if b > 2:
        conf[2] = conf[2].clamp(max=CONF)  # image 2: every detection filtered out by conf
    d_cls = torch.randint(0, nc, (b, most_dets), generator=g).float()
    valid = torch.arange(most_dets) < d_count[:, None]
    det = Detections(boxes=d_boxes * valid[..., None], conf=conf * valid, cls=d_cls * valid, count=d_count)
    return det, (t_cls, t_boxes, t_count)


def ultralytics_matrix(det: Detections, targets, nc: int, conf: float = CONF) -> np.ndarray:
    cm = ConfusionMatrix(names={i: str(i) for i in range(nc)})
    t_cls, t_boxes, t_count = targets
    for i in range(det.conf.shape[0]):
        n, m = int(det.count[i]), int(t_count[i])
        cm.process_batch({"bboxes": det.boxes[i, :n], "conf": det.conf[i, :n], "cls": det.cls[i, :n]},
                         {"cls": t_cls[i, :m], "bboxes": t_boxes[i, :m]}, conf=conf)
    return cm.matrix


def batched_matrix(det: Detections, targets, nc: int, conf: float = CONF) -> np.ndarray:
    t_cls, t_boxes, t_count = targets
    valid_t = torch.arange(t_cls.shape[1]) < t_count[:, None]
    return confusion_counts(det, det.valid(), t_boxes, t_cls, valid_t, nc, conf).numpy().astype(np.float64)


@pytest.mark.parametrize("nc", [1, 3])
def test_the_counts_are_ultralytics_process_batch_image_by_image(nc):
    claimed = false_positives = 0
    for seed in range(40):
        det, targets = random_batch(8, nc, seed=100 * nc + seed)
        want = ultralytics_matrix(det, targets, nc)
        got = batched_matrix(det, targets, nc)
        assert np.array_equal(got, want), (seed, got, want)
        claimed += want[:nc, :nc].sum()  # targets claimed by a detection
        false_positives += want[:nc, nc].sum()
    assert claimed > 300 and false_positives > 300  # the comparison is not of empty matrices


def test_images_without_targets_or_detections_or_kept_detections():
    det, targets = random_batch(3, 3, seed=1)
    want = ultralytics_matrix(det, targets, 3)
    assert int(targets[2][0]) == 0 and int(det.count[1]) == 0 and bool((det.conf[2] <= CONF).all())
    assert np.array_equal(batched_matrix(det, targets, 3), want)


def test_a_batch_without_detections_counts_every_target_missed():
    t_cls, t_boxes = torch.tensor([[0.0, 2.0], [1.0, 0.0]]), torch.tensor([[[0.0, 0, 10, 10], [5, 5, 20, 20]]] * 2)
    t_count = torch.tensor([2, 1])
    none = Detections(boxes=torch.zeros(2, 0, 4), conf=torch.zeros(2, 0), cls=torch.zeros(2, 0),
                      count=torch.zeros(2, dtype=torch.long))
    want = ultralytics_matrix(none, (t_cls, t_boxes, t_count), 3)
    assert np.array_equal(batched_matrix(none, (t_cls, t_boxes, t_count), 3), want)
    assert want[3].tolist() == [1, 1, 1, 0] and want.sum() == 3


def test_two_detections_competing_for_one_target_worked_out_by_hand():
    """One target of class 0, [0, 0, 10, 10]. Detection 0 (class 1, conf 0.5) overlaps it by 0.81, detection 1
    (class 0, conf 0.5, the same confidence: detection order decides) by 1.0, detection 2 (class 2, conf 0.9) by 0.25
    (under 0.45: no candidate), detection 3 (class 0, conf 0.2: under CONF, dropped). Detection 0 is visited first
    and claims the target although detection 1 overlaps it more: [1, 0] += 1; detection 1 finds the row zeroed and,
    like detection 2, is a false positive: [0, bg] += 1, [2, bg] += 1. Detection 3 counts nowhere."""
    det = Detections(boxes=torch.tensor([[[0.0, 0, 9, 9], [0, 0, 10, 10], [0, 0, 5, 5], [0, 0, 10, 10]]]),
                     conf=torch.tensor([[0.5, 0.5, 0.9, 0.2]]), cls=torch.tensor([[1.0, 0.0, 2.0, 0.0]]),
                     count=torch.tensor([4]))
    targets = torch.tensor([[0.0]]), torch.tensor([[[0.0, 0.0, 10.0, 10.0]]]), torch.tensor([1])
    want = np.zeros((4, 4))
    want[1, 0] = want[0, 3] = want[2, 3] = 1
    assert np.array_equal(ultralytics_matrix(det, targets, 3), want)  # the hand count is Ultralytics'
    assert np.array_equal(batched_matrix(det, targets, 3), want)
    # Detection 1 first instead (higher confidence): it claims the target, class right, and detection 0 is background.
    det = det._replace(conf=torch.tensor([[0.5, 0.6, 0.9, 0.2]]))
    want = np.zeros((4, 4))
    want[0, 0] = want[1, 3] = want[2, 3] = 1
    assert np.array_equal(batched_matrix(det, targets, 3), want)


def test_equal_ious_go_to_the_first_target_and_an_iou_at_the_threshold_does_not_count():
    """Targets A (class 2) and B (class 0) are the same box, C (class 1) another. Detection 0 (class 0) covers A and
    B alike (IoU 1): it claims the first, A, [0, 2] += 1, and B is missed, [bg, 0] += 1. Detection 1 (class 1) is
    45 of C's 100 pixels: IoU exactly 0.45 in float32 (45 / 100, the 1e-7 lost in 100 + 1e-7), not above 0.45: a
    false positive, [1, bg] += 1, and C is missed, [bg, 1] += 1."""
    det = Detections(boxes=torch.tensor([[[0.0, 0, 10, 10], [50, 50, 59, 55]]]), conf=torch.tensor([[0.9, 0.8]]),
                     cls=torch.tensor([[0.0, 1.0]]), count=torch.tensor([2]))
    targets = (torch.tensor([[2.0, 0.0, 1.0]]), torch.tensor([[[0.0, 0, 10, 10], [0, 0, 10, 10], [50, 50, 60, 60]]]),
               torch.tensor([3]))
    want = np.zeros((4, 4))
    want[0, 2] = want[3, 0] = want[1, 3] = want[3, 1] = 1
    assert np.array_equal(ultralytics_matrix(det, targets, 3), want)
    assert np.array_equal(batched_matrix(det, targets, 3), want)
