"""train_batch<N>.jpg: rank 0's first training batches drawn with their boxes (and a pose batch's keypoints, a
segmentation batch's masks), as Ultralytics' trainer plots them (train.plots): the run's first three and, with
close_mosaic, the first three without mosaic, named by the step's index in the run as Ultralytics names them.

Off the step's path: after the step is launched, the batch's first images (plot_images draws 16 at most) and its
labels are copied to the host, on a GPU queued on the training stream into page-locked memory, so that the host does
not wait; the plotter's thread waits for the copy, then draws (ultralytics/plots.py). The batch is the step's own
input, whichever pipeline made it (loader.augment_on=cpu: Ultralytics' batch after to_device; gpu: the device's
augmented batch, the network's input type and layout): images in [0, 1], boxes normalised xywh.
"""

from __future__ import annotations

import torch

from launcher.rank.loop.loop import Hook, TrainLoop

PLOTTED = 3  # Ultralytics' trainer plots its first three batches, and as many after mosaic closes
MAX_IMAGES = 16  # plot_images draws the first 16 images of a batch
LABEL_KEYS = ("cls", "bboxes", "batch_idx", "keypoints", "masks")  # what plot_images draws, as the task has it


class TrainBatchPlots(Hook):
    """Rank 0: the plotter draws train_batch<ni>.jpg for the steps `ni` of the first batches and, when mosaic closes
    at epoch `close_at`, of that epoch's first ones."""

    def __init__(self, plotter, steps_per_epoch: int, close_at: int | None):
        self.plotter = plotter
        self.steps = set(range(PLOTTED))
        if close_at is not None:
            self.steps |= {close_at * steps_per_epoch + i for i in range(PLOTTED)}

    def after_launch(self, loop: TrainLoop) -> None:
        if loop.ni in self.steps:
            batch, copied = host_copy(loop.batch)
            self.plotter.train_batch(batch, loop.ni, copied)


def host_copy(batch: dict, images: int = MAX_IMAGES) -> tuple[dict, torch.cuda.Event | None]:
    """What plotting `batch` needs, on the host: its first `images` images and every label (plot_images leaves out
    those of other images). From a GPU, queued on the current stream (the returned event completes with the copy);
    on the CPU, copied at once (the step's buffers may be reused)."""
    per_image = "batch_idx" not in batch  # a classifier's batch: a class per image, the first `images` of them
    tensors = {"img": batch["img"][:images], **{k: batch[k][:images] if per_image else batch[k]
                                                for k in LABEL_KEYS if k in batch}}
    cuda = tensors["img"].is_cuda
    out = {"im_file": list(batch["im_file"][:images])}
    for k, t in tensors.items():
        out[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) if cuda else t.clone()
    copied = None
    if cuda:
        copied = torch.cuda.Event()
        copied.record()
    return out, copied
