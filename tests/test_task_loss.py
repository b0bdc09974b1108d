"""The segmentation loss's mask term over the whole batch (rank/ultralytics/task_loss.py mask_loss) is Ultralytics'
per-image loop: the same value and gradients, to float rounding, with overlapping masks and with a mask per object,
on batches with crowded images, single objects and images without any foreground."""

from __future__ import annotations

import pytest
import torch
from ultralytics.utils.loss import v8SegmentationLoss

from launcher.rank.ultralytics.task_loss import mask_loss

ANCHORS, MASK = 300, 40  # anchors per image, the prototypes' side
IMGSZ = 4 * MASK  # the image's side: the prototypes are at a quarter of it


def _inputs(counts: list[int], overlap: bool, seed: int) -> dict:
    """What v8SegmentationLoss.loss hands calculate_segmentation_loss: for image i, counts[i] objects, each with its
    mask and box, and a few foreground anchors per object (none where counts[i] is 0)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(counts)
    fg_mask = torch.zeros(batch, ANCHORS, dtype=torch.bool)
    target_gt_idx = torch.zeros(batch, ANCHORS, dtype=torch.long)
    target_bboxes = torch.zeros(batch, ANCHORS, 4)
    masks = torch.zeros(batch, MASK, MASK) if overlap else torch.zeros(sum(counts), MASK, MASK)
    batch_idx = torch.tensor([float(i) for i, n in enumerate(counts) for _ in range(n)])
    instance = 0
    for i, n in enumerate(counts):
        for k in range(n):
            x0, y0 = (torch.rand(2, generator=g) * MASK * 0.6).long().tolist()
            w, h = (torch.randint(3, MASK // 2, (2,), generator=g)).tolist()
            if overlap:  # later objects drawn over earlier ones, as Ultralytics' polygons2masks_overlap
                masks[i, y0:y0 + h, x0:x0 + w] = k + 1
            else:
                masks[instance, y0:y0 + h, x0:x0 + w] = 1
            instance += 1
            anchors = torch.randperm(ANCHORS, generator=g)[:int(torch.randint(1, 12, (1,), generator=g))]
            fg_mask[i, anchors] = True
            target_gt_idx[i, anchors] = k
            scale = IMGSZ / MASK  # the box in pixels, a little looser than the mask
            target_bboxes[i, anchors] = torch.tensor([x0 - 0.5, y0 - 0.5, x0 + w + 0.5, y0 + h + 0.5]) * scale
    return {
        "fg_mask": fg_mask, "masks": masks, "target_gt_idx": target_gt_idx, "target_bboxes": target_bboxes,
        "batch_idx": batch_idx.view(-1, 1), "proto": torch.randn(batch, 32, MASK, MASK, generator=g).requires_grad_(),
        "pred_masks": torch.randn(batch, ANCHORS, 32, generator=g).requires_grad_(),
        "imgsz": torch.tensor([IMGSZ, IMGSZ], dtype=torch.float32),
    }


def _ultralytics(inputs: dict, overlap: bool) -> torch.Tensor:
    """v8SegmentationLoss.calculate_segmentation_loss itself, on a stand-in that holds the one attribute it reads."""
    holder = type("Holder", (), {"overlap": overlap, "single_mask_loss": staticmethod(v8SegmentationLoss.single_mask_loss)})
    return v8SegmentationLoss.calculate_segmentation_loss(holder(), *inputs.values())


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "mask-per-object"])
@pytest.mark.parametrize("counts", [[3, 0, 7, 1, 2, 5], [1, 1, 1, 1], [0, 0, 0, 4], [40, 0, 25, 1]],
                         ids=["mixed", "one-each", "one-image", "crowded"])
def test_the_batched_mask_term_is_ultralytics_per_image_loop(counts, overlap):
    ours_in, theirs_in = _inputs(counts, overlap, seed=sum(counts)), _inputs(counts, overlap, seed=sum(counts))
    ours, theirs = mask_loss(*ours_in.values(), overlap=overlap), _ultralytics(theirs_in, overlap)
    assert theirs > 0  # the case has foreground, and a loss on it
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    ours.backward()
    theirs.backward()
    for name in ("proto", "pred_masks"):
        assert theirs_in[name].grad.abs().sum() > 0
        torch.testing.assert_close(ours_in[name].grad, theirs_in[name].grad, rtol=1e-4, atol=1e-8, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "mask-per-object"])
def test_on_cuda_under_autocast_the_batched_mask_term_is_ultralytics_per_image_loop(overlap):
    """As the step runs it: on the GPU, the prototypes' products in fp16 under autocast."""
    counts = [3, 0, 7, 1, 2, 5, 40, 0]
    ours_in, theirs_in = (_on_cuda(_inputs(counts, overlap, seed=1)) for _ in range(2))
    with torch.autocast("cuda", dtype=torch.float16):
        ours, theirs = mask_loss(*ours_in.values(), overlap=overlap), _ultralytics(theirs_in, overlap)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
    ours.backward()
    theirs.backward()
    for name in ("proto", "pred_masks"):
        torch.testing.assert_close(ours_in[name].grad, theirs_in[name].grad, rtol=1e-3, atol=1e-6, msg=name)


def _on_cuda(inputs: dict) -> dict:
    return {k: v.detach().cuda().requires_grad_(v.requires_grad) for k, v in inputs.items()}
