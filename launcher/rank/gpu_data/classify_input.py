"""The GPU input pipeline of a classification model (loader.augment_on=gpu with a -cls model): the loader's workers
read the class folders' file bytes (rank/data/encoded.py's EncodedTrainDataset, each image's class as its one
label), the device decodes them (gpu_input.Decoder: nvJPEG, the CPU for what it refuses) and
classify_augment.ClassifyAugment augments the whole batch there, with Ultralytics' classification transforms. No image
buffer: a classifier's batch is its own images alone (no mosaic partners).
"""

from __future__ import annotations

import numpy as np
import torch

from launcher.rank.data.encoded import EncodedBatch, EncodedImages
from launcher.rank.gpu_data.classify_augment import ClassifyAugment
from launcher.rank.gpu_data.gpu_input import Decoded, Decoder, InputTimer


def class_folder_images(samples: list) -> EncodedImages:
    """A ClassificationDataset's `samples` (file, class index, ...) as EncodedImages: one label per image, its class
    (its box unused)."""
    n = len(samples)
    return EncodedImages(files=[str(s[0]) for s in samples], cls=np.array([s[1] for s in samples], np.float32),
                         xywh=np.zeros((n, 4), np.float32), starts=np.arange(n + 1, dtype=np.int64))


class ClassifyInput:
    """`ClassifyInput(...)(encoded_batch, generator)` -> Ultralytics' classification batch ({img, cls, im_file}), `img`
    already the network's input. `decoded(encoded_batch)` is the decode alone (rank/data/pipeline.py's TrainInputs runs
    it in a thread of its own). The draws come from a CPU generator seeded with `generator`'s seed: a batch is a
    function of the seed, its step and its rank (rank/components.py seeds it)."""

    def __init__(self, augment: ClassifyAugment, decoder: Decoder, *, device: torch.device, timed: bool = True):
        self.augment, self.decode, self.device = augment, decoder, device
        self.timer = InputTimer(device, timed)

    def warm_up(self) -> None:
        """Nothing to compile ahead: the augmentation is PyTorch's own kernels."""

    def decoded(self, batch: EncodedBatch) -> Decoded:
        return Decoded(batch, *self.decode(batch))

    def __call__(self, batch: EncodedBatch | Decoded, generator: torch.Generator) -> dict:
        start = self.timer.start()
        batch, images, _ = batch if isinstance(batch, Decoded) else self.decoded(batch)
        s = self.augment.imgsz
        sizes = torch.tensor([tuple(im.shape[1:]) if im is not None else (s, s) for im in images],
                             dtype=torch.int64).view(-1, 2)
        draws = self.augment.draws(sizes, torch.Generator().manual_seed(generator.initial_seed()))
        img = self.augment(images, draws, self.device)
        cls = batch.cls.long()
        cls = cls.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else cls
        self.timer.stop(start, len(images))
        return {"img": img, "cls": cls, "im_file": [self.decode.files[i] for i in batch.indices]}

    def take_gpu_time(self) -> tuple[float, int]:
        """(GPU milliseconds, images) of the decode and augmentation measured since the last call (the batches
        whose events have completed; never waits)."""
        return self.timer.take()
