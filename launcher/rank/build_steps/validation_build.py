"""What a rank validates with (components.Rank's step 4): the validation loader and the validator val.engine names,
the fast one (the split preloaded on the device, rank/validate/) or Ultralytics' own DetectionValidator."""

from __future__ import annotations

from functools import partial

from launcher.rank.build_steps import training_input
from launcher.rank.ultralytics import build, datasets
from launcher.rank.ultralytics.fast_validation import FastValidator
from launcher.rank.ultralytics.validation import Validator


def validation_set(rank) -> tuple:
    """(the validation loader, the validator) of the components.Rank being built, after its training set (max_det is
    aligned with both datasets before the validator copies the hyperparameters)."""
    plan = rank.plan
    loader = datasets.val_loader(rank.hyp, rank.data, plan.val_batch, rank.stride, 2 * plan.workers_per_rank,
                                 rank.device, bind=partial(training_input.on_worker_cores, rank.cores),
                                 pin_memory=plan.val_engine == "ultralytics")
    if "val" in rank.caches:  # the node's decoded validation images: no decoding in the loader's workers
        datasets.attach_cache(loader.dataset, rank.caches["val"])
    build.align_max_det(rank.net, rank.hyp, rank.train_dataset, loader.dataset)  # before the copies
    return loader, validator(rank, loader)


def validator(rank, loader):
    """val.engine: the fast validator (the split preloaded on the device, rank/validate/) or Ultralytics' own
    DetectionValidator over the loader; both shard the split as the loader does."""
    beat = lambda: rank.heartbeat.working()  # noqa: E731 (a long validation is progress, not a hang)
    if rank.plan.val_engine == "ultralytics":
        return Validator(loader, rank.hyp, rank.folder.path, on_batch=beat)
    return FastValidator(loader, rank.hyp, rank.folder.path,
                         batch=rank.plan.val_batch, amp_dtype=rank.amp_dtype, cuda_graphs=rank.plan.val_cuda_graphs,
                         folded=rank.settings.val.fold_batchnorm is True,
                         device=rank.device, on_batch=beat, log=rank.log, detail=rank.detail)
