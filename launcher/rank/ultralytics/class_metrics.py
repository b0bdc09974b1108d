"""Ultralytics' detection metrics (DetMetrics.process, without plots) with the same results, without a pass over
every detection for each class.

Ultralytics' ap_per_class (utils/metrics.py, 8.4.190) selects each class's detections with a boolean mask over all of
them, so its cost grows with detections x classes: an untrained model's max_det detections per image at conf 0.001,
or COCO's 80 classes, make it a large part of a validation on the host. Here the detections, sorted by confidence
with Ultralytics' own call (so ties keep its order), are grouped by class once (a stable sort: each class keeps that
order), and each class reads its slice. Every computation on a class's detections is ap_per_class's, on the same
values in the same order, so the results are the same bit for bit (tests/test_fast_validation.py compares them).

Reaches into Ultralytics: DetMetrics' stats, box.update, nt_per_class and nt_per_image, as DetMetrics.process sets
them; compute_ap and smooth called as ap_per_class calls them.
"""

from __future__ import annotations

import numpy as np
from ultralytics.utils.metrics import DetMetrics, compute_ap, smooth

CURVE_POINTS = 1000  # ap_per_class's confidence axis


def ap_per_class(tp: np.ndarray, conf: np.ndarray, pred_cls: np.ndarray, target_cls: np.ndarray,
                 eps: float = 1e-16) -> tuple:
    """What Ultralytics' ap_per_class returns with plot=False: tp, fp, p, r, f1, ap, unique_classes, p_curve, r_curve,
    f1_curve, x, prec_values."""
    i = np.argsort(-conf)  # ap_per_class's own call: ties in the order it leaves them
    i = i[np.argsort(_class_keys(pred_cls[i]), kind="stable")]  # each class's detections together, still in that order
    tp, conf, pred_cls = tp[i], conf[i], pred_cls[i]

    unique_classes, nt = np.unique(target_cls, return_counts=True)
    nc = unique_classes.shape[0]
    x, prec_values = np.linspace(0, 1, CURVE_POINTS), []
    ap, p_curve, r_curve = np.zeros((nc, tp.shape[1])), np.zeros((nc, CURVE_POINTS)), np.zeros((nc, CURVE_POINTS))
    starts = np.searchsorted(pred_cls, unique_classes, side="left")
    ends = np.searchsorted(pred_cls, unique_classes, side="right")
    for ci, (start, end) in enumerate(zip(starts, ends)):
        n_l, n_p = nt[ci], end - start
        if n_p == 0 or n_l == 0:
            prec_values.append(np.zeros_like(x))
            continue
        mine, mine_conf = tp[start:end], conf[start:end]
        fpc = (1 - mine).cumsum(0)
        tpc = mine.cumsum(0)
        recall = tpc / (n_l + eps)
        r_curve[ci] = np.interp(-x, -mine_conf, recall[:, 0], left=0)
        precision = tpc / (tpc + fpc)
        p_curve[ci] = np.interp(-x, -mine_conf, precision[:, 0], left=1)
        for j in range(tp.shape[1]):
            ap[ci, j], mpre, mrec = compute_ap(recall[:, j], precision[:, j])
            if j == 0:
                prec_values.append(np.interp(x, mrec, mpre))

    prec_values = np.array(prec_values) if prec_values else np.zeros((1, CURVE_POINTS))
    f1_curve = 2 * p_curve * r_curve / (p_curve + r_curve + eps)
    i = smooth(f1_curve.mean(0), 0.1).argmax() if nc else 0
    p, r, f1 = p_curve[:, i], r_curve[:, i], f1_curve[:, i]
    tp = (r * nt).round()
    fp = (tp / (p + eps) - tp).round()
    return tp, fp, p, r, f1, ap, unique_classes.astype(int), p_curve, r_curve, f1_curve, x, prec_values


def _class_keys(pred_cls: np.ndarray) -> np.ndarray:
    """Keys that sort as the class ids do: int16 where they are all whole numbers in its range (numpy sorts those
    stably by radix), else the ids themselves."""
    keys = pred_cls.astype(np.int16)
    return keys if np.array_equal(keys, pred_cls) else pred_cls


def process(metrics: DetMetrics) -> None:
    """DetMetrics.process(plot=False) on its collected stats: its box metrics and per-class target counts set; a
    PoseMetrics' pose metrics too (PoseMetrics.process: the same from its keypoint matches, tp_p), a SegmentMetrics'
    mask metrics (SegmentMetrics.process: from its masks' matches, tp_m)."""
    stats = {k: np.concatenate(v, 0) for k, v in metrics.stats.items()}
    results = ap_per_class(stats["tp"], stats["conf"], stats["pred_cls"], stats["target_cls"])[2:]
    metrics.box.nc = len(metrics.names)
    metrics.box.update(results)
    for key, own in ("tp_p", "pose"), ("tp_m", "seg"):  # PoseMetrics' keypoint matches, SegmentMetrics' masks'
        if key in stats:
            getattr(metrics, own).nc = len(metrics.names)
            getattr(metrics, own).update(ap_per_class(stats[key], stats["conf"], stats["pred_cls"],
                                                      stats["target_cls"])[2:])
    metrics.nt_per_class = np.bincount(stats["target_cls"].astype(int), minlength=len(metrics.names))
    metrics.nt_per_image = np.bincount(stats["target_img"].astype(int), minlength=len(metrics.names))
