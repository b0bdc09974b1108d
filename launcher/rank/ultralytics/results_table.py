"""Ultralytics' validation table, written the same way by both validation engines on rank 0: the header that
Ultralytics' progress bar carries (DetectionValidator.get_desc), the `all` row, and after the run's final validation a
row per class, as DetectionValidator.print_results writes them after its trainer's final_eval (verbose, outside
training; only with more than one class, its rule).

    Class     Images  Instances      Box(P          R      mAP50  mAP50-95)
      all         16         41      0.598      0.893      0.855      0.618
   circle          9         14      0.649        0.5      0.554      0.287
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache, partial

import ultralytics.engine.validator as base_validator
from ultralytics.models.yolo.detect import DetectionValidator
from ultralytics.utils import LOGGER


def print_table(v: DetectionValidator, *, per_class: bool) -> None:
    """The header and print_results' rows of `v`'s last validation (its processed metrics and images seen); with
    `per_class`, a row per class too. It reads what the validation left, so it may come later."""
    LOGGER.info(v.get_desc())
    training, verbose = v.training, v.args.verbose
    v.training, v.args.verbose = not per_class, True  # print_results writes the classes outside training only
    own = next(c for c in type(v).__mro__ if "print_results" in vars(c) and c is not _Table)  # Ultralytics' own
    try:
        own.print_results(v)
    finally:
        v.training, v.args.verbose = training, verbose


class _Table:
    """Before a DetectionValidator (or its segmentation, pose or obb subclass) in the bases: print_table's table, the
    header and a row per class when `per_class` is set."""

    per_class = False

    def print_results(self) -> None:
        print_table(self, per_class=self.per_class)


@cache
def table_validator(validator: type) -> type:
    """Ultralytics' `validator` (val.engine=ultralytics: DetectionValidator, its segmentation, pose and obb
    subclasses, ClassificationValidator: top-1 and top-5 on the `all` row) writing print_table's table."""
    return type(f"Table{validator.__name__}", (_Table, validator), {})



@contextmanager
def no_progress_bar():
    """BaseValidator's progress bar off while Ultralytics' engine validates: its description is the table's header,
    which print_table writes (on a file, the bar would write it again with its progress, behind a carriage return)."""
    bar = base_validator.TQDM
    base_validator.TQDM = partial(bar, disable=True)
    try:
        yield
    finally:
        base_validator.TQDM = bar
