"""The only package of ddp-launch that imports Ultralytics. Ranks train Ultralytics' detection, segmentation, pose,
obb and classification models with its own model, datasets, augmentation, loss and validator (what differs per task: tasks.py);
ddp-launch owns the process group, the loop, the loader and the update.

Public seams used as documented: get_cfg, check_det_dataset, DetectionModel, SegmentationModel, PoseModel, OBBModel,
ClassificationModel (and .load, .loss, .init_criterion), load_checkpoint, guess_model_task, YOLODataset /
build_yolo_dataset / build_dataloader, ClassificationDataset, ModelEMA, strip_optimizer, E2ELoss(model, loss_fn),
DetectionValidator, SegmentationValidator, PoseValidator, OBBValidator, ClassificationValidator,
callbacks.get_default_callbacks, YAML, YOLO (the baseline).

Reaches into internals, each in one place:
- validation.py: the trainer attributes DetectionValidator reads in training mode (a stand-in trainer).
- results_table.py: the validator's own print_results (DetectionValidator's, ClassificationValidator's) called with `training` and `args.verbose` switched (the rows
  per class outside final_eval), and the TQDM that BaseValidator.__call__ reads from its module swapped for a
  disabled one while Ultralytics' engine validates.
- fast_validation.py: a DetectionValidator that runs no batch: init_metrics, its metrics.stats, confusion_matrix,
  seen, speed, plot_val_samples/plot_predictions, finalize_metrics and print_results called directly (the
  statistics it would have collected are rank/validate/'s, in its layout); get_stats' work done by class_metrics.
  For a pose model, a PoseValidator the same way: its sigma and kpt_shape read (set by its init_metrics), and its
  postprocess, _prepare_batch and _process_batch (kpt_iou, the OKS) re-stated over whole batches in rank/validate/;
  for a segmentation model, a SegmentationValidator: its postprocess (process_mask, crop_mask), _prepare_batch (the
  overlapping masks split per target) and _process_batch (mask_iou) re-stated the same way (rank/validate/masks.py).
- deferred_plots.py: the validators' plot_val_samples, plot_predictions, get_stats and finalize_metrics overridden
  (with args.plots switched off around the last two) so that the final validation's plots are handed to the run's
  plotter; the curves drawn by a fresh metrics object of the validation's type (its `stats`, process(plot=True)),
  the confusion matrix by a copy's ConfusionMatrix.plot.
- class_metrics.py: DetMetrics.process re-stated (box.update, nt_per_class, nt_per_image; PoseMetrics.process's
  pose.update, SegmentMetrics.process's seg.update) on ap_per_class re-stated with each class's detections grouped
  once instead of masked per class; compute_ap and smooth called.
- folded.py: Conv / DWConv's `conv`, `bn` and `act`, folded as BaseModel.fuse folds them, in a copy that is never
  saved (FastValidator(folded=True), off by default).
- loss.py: v8DetectionLoss.get_assigned_targets_and_loss and .preprocess re-implemented (the global normaliser, the
  host's target count); TaskAlignedAssigner.get_box_metrics / select_candidates_in_gts and BboxLoss.forward overridden;
  DFLoss.__call__ re-stated.
- task_loss.py: v8SegmentationLoss's and v8PoseLoss's get_assigned_targets_and_loss (their box terms, which their
  .loss calls first) handed to that detection loss, and their calculate_segmentation_loss / calculate_keypoints_loss
  rescaled to the ranks' foreground; calculate_segmentation_loss re-stated over the whole batch (single_mask_loss
  per foreground anchor, crop_mask called); v8OBBLoss's assigner wrapped (its target weight read) and its .loss
  rescaled to the ranks' mean target weight; v8ClassificationLoss's mean multiplied by the batch's images.
- datasets.py: BaseDataset.get_img_files on a stand-in (the files of a split); the image lists and mosaic buffer of
  BaseDataset and Mosaic.buffer_enabled (the node-shared cache, loader.mosaic_buffer); imread and load_image's
  resize rule (the cache's pixels); InfiniteDataLoader.iterator set from torch's DataLoader._get_iterator (the
  validation loader's workers started before its first iteration, start_workers); ClassificationDataset.__getitem__
  extended with its sample's file (im_file).
- tasks.py: ClassificationTrainer.get_model's dropout rule re-stated (the head's Dropout at hyp.dropout).
- build.py: BaseTrainer.build_optimizer's parameter groups, DetectionTrainer's class weights and model attributes,
  the frozen-layer rule of BaseTrainer._setup_train and init_seeds' switches, each re-stated;
  DetectionValidator._check_max_det called.
- blocks.py: C2f's, SPPF's and Concat's forward re-stated on Triton copies (swapped in while the training graphs are
  captured: rank/step/triton_modules.py); only modules whose class keeps one of those forwards.
- checkpoint.py: BaseTrainer.save_model's checkpoint keys, and strip_optimizer's steps re-stated for the last
  checkpoint of a run, still in memory (stripped).
- baseline.py: BaseTrainer.read_results_csv and check_amp replaced for the benchmark's baseline cell.
- time_to_model_ultralytics.py: the same two for the time-to-model benchmark's Ultralytics side, and engine.trainer's
  strip_optimizer wrapped to stamp when final_eval has stripped the checkpoints.

They are tested against a window of releases (inputs/ultralytics_files.py; tests/test_ultralytics_reaches.py checks
each reach), and what differs inside it is named in releases.py: importing this package checks it, as the launcher checks the package metadata when it plans, so a
release outside is refused before any rank starts unless DDP_LAUNCH_ALLOW_ULTRALYTICS=1 asks to try it.
"""

from ultralytics import __version__ as _installed

from launcher.inputs.ultralytics_files import allowed_outside_window, version_problem

if version_problem(_installed) and not allowed_outside_window():
    raise ImportError(version_problem(_installed))
