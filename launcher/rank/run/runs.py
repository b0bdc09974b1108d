"""The two things a rank runs, as loop configurations over the same components (rank/components.py): a training
run, and a ddp-bench cell. Each builds its hook list here, in one place.

The order rule: at each point of the loop (before_train, before_epoch, before_step, before_launch, after_launch,
after_step, after_epoch, after_train: rank/loop/loop.py) the hooks run in list order, so a hook stands after every hook
whose work it reads and before every hook that reads its own; the comment beside each entry says which. A hook only
rank 0 runs is built by a `_rank0_...` function from the inputs it takes, and is left out on the other ranks.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import psutil
import torch
from torch.profiler import profile

from launcher.plan.plan import LaunchPlan
from launcher.plan.task_rules import rules
from launcher.rank.loop import checkpoint_io
from launcher.rank.run import hooks as h
from launcher.rank.run import progress
from launcher.rank.components import Rank
from launcher.rank.loop.loop import Hook, TrainLoop
from launcher.rank.metrics import results, run_summary, step_profile
from launcher.rank.metrics.epoch_figures import EpochFigures
from launcher.rank.metrics.gpu_monitor import GpuMonitor
from launcher.rank.metrics.meter import StepMeter
from launcher.rank.metrics.timeline import Timed, Timeline, TimelineEdges
from launcher.rank.run.train_batches import TrainBatchPlots
from launcher.rank.step.captured_step import CapturedStep
from launcher.rank.ultralytics import build, checkpoint
from launcher.rank.ultralytics.plots import Plotter
from launcher.rank.ultralytics.tracking import Tracking
from launcher.rank.ultralytics.validation import label_loss_items
from launcher.run_folder import RunFolder, previous_of

METER_SKIP_STEPS = 10  # a training run's warm-up, left out of its steady-state figures
PROFILED_STEPS = 10  # bench.profile: the loop's steps after the warm-up profiled, and as many data-free ones


def _meter(r: Rank, skip_steps: int) -> tuple[StepMeter, GpuMonitor | None]:
    gpus = list(range(r.plan.devices_per_rank)) if r.plan.mode == "dp" else [r.device.index or 0]
    monitor = GpuMonitor(gpus) if r.device.type == "cuda" else None
    return StepMeter(r.device, skip_steps=skip_steps, monitor=monitor,
                     in_flight=r.settings.train.steps_in_flight), monitor


def train(cfg: dict, plan: LaunchPlan, folder: RunFolder, stamps: dict | None = None) -> dict | None:
    """Train on this rank; rank 0 writes summary.json. Returns the summary on rank 0. `stamps`: the process's own
    for the timeline (worker.py: its start, its imports done)."""
    timeline = Timeline(stamps)
    r = Rank(cfg, plan, folder)
    plan = r.plan  # with train.batch_per_device=auto, the batch the ranks measured
    try:
        timeline.stamp("components_built")
        timeline.setup = r.setup_stamps
        timeline.setup_memory = r.setup_memory
        settings, state = r.settings, r.state
        meter, monitor = _meter(r, METER_SKIP_STEPS)
        early_stop = h.EarlyStop(int(settings.train.patience), r.log)
        layout = checkpoint.Layout(r.ema, r.hyp)
        checkpointer = r.checkpointer(partial(_layout, r, layout, early_stop), layout.complete, checkpoint.stripped,
                                      extra={"early_stop": early_stop})
        r.restore(checkpointer)
        samples = h.RecordSamples() if settings.debug.record_samples else None
        epochs, on_rank0 = int(settings.train.epochs), r.rank == 0
        integrations = settings.log.integrations or []
        input_time = h.InputTime(r.gpu_input, r.inputs, METER_SKIP_STEPS) if r.gpu_input else None
        plotter = Plotter(folder.path, r.log) if on_rank0 and settings.train.plots else None
        figures = EpochFigures(meter, monitor, r.device, r.comm, r.heartbeat) if integrations else None
        validate = partial(_validate, r, plotter)
        evaluate = h.Evaluate(validate, validate, partial(_best_weights, r.folder.weights, checkpointer),
                              interval=int(settings.train.val_interval), comm=r.comm, device=r.device, log=r.log,
                              final_table=r.validator.print_table)
        if on_rank0:  # each validation, and the final one, timed for the timeline
            evaluate = Timed(evaluate, timeline, name="val", final="final_val", keep=lambda loop: loop.state.validated)
        save = _rank0_checkpoint(checkpointer, int(settings.train.save_period), r.folder.weights, timeline) \
            if on_rank0 else None
        hooks: list[Hook | None] = [
            # rank 0: first at every point, so that an epoch's start is stamped before closing mosaic, its training
            # end before the validation, and the last epoch's end before any after_train work
            _rank0_timeline_edges(timeline, r.inputs) if on_rank0 else None,
            # before each epoch and step: the lr and momentum of the warm-up and the schedule, before anything steps
            h.LRSchedule(r.schedule, plan.warmup_iterations or 0),
            # before each epoch: train mode and mosaic's close; after it: the loss's and the EMA's end-of-epoch
            # updates, before Evaluate validates the EMA
            h.ModelEpochs(train_mode=partial(build.train_mode, r.net, r.frozen), close_at=r.close_at,
                          criterion=r.net.criterion, ema=r.ema, net=r.net, log=r.log),
            # stamps the batch in hand and the step's launch before any other host work of the step's boundary; pauses
            # after each epoch's steps: validation and checkpoints are not training time
            h.Meter(meter, r.inputs, monitor),
            # (log.integrations) the epoch's images/s, data wait, GPU use and memory from every rank, read by Tracking
            figures,
            # rank 0 (train.plots): copies the first batches for train_batch<N>.jpg, queued behind the step
            _rank0_train_batch_plots(plotter, r.sampler.batches_per_epoch, r.close_at) if plotter else None,
            # after each step, first: the watchdog sees the step done
            h.Heartbeat(r.heartbeat),
            # (debug.record_samples) the images just trained on, before a fault or a signal ends the run
            samples,
            # a test's fault fires after a step, as a real one would
            h.FaultInjection(r.faults),
            # every rank agrees on a signal (a collective each step); rank 0 saves, all exit
            h.StopOnSignal(r.comm, r.heartbeat, r.inputs, save=lambda loop: checkpointer.save(wait=True), log=r.log),
            # after the first step the validation loader starts reading; after each later one a slice goes to the
            # device, so the validation finds its split there
            h.ReadAhead(getattr(r.validator, "read_ahead", None), getattr(r.validator, "place_ahead", None)),
            # validation (every rank, sharded) at the interval and after the last epoch, after ModelEpochs' EMA update
            evaluate,
            # rank 0: the epoch's row with Evaluate's metrics, before the checkpoint, which embeds results.csv
            _rank0_results_csv(folder.path, r.validator.metric_keys, r.schedule.lrs) if on_rank0 else None,
            # rank 0 (log.integrations): Ultralytics' integration callbacks, with the epoch's losses, metrics and
            # figures; at the end after the plots they may upload are drawn
            _rank0_tracking(integrations, folder.path, r, plotter, figures) if on_rank0 and integrations else None,
            # rank 0 decides on the new fitness, before the checkpoint records its memory
            early_stop,
            # rank 0: last.pt / best.pt / epochN.pt written in a thread while the next epoch trains; the final weights
            save,
            # rank 0 (train.plots): results.png after the last epoch, drawn in the plotter's thread
            _rank0_plots(plotter, folder.path, getattr(r.train_dataset, "labels", None), r.data["names"]) if plotter else None,
            # every log.interval_steps steps, and the epoch's line with Evaluate's mAP
            progress.Progress(meter, r.optimizer, r.device, r.rank, int(settings.log.interval_steps),
                              r.log, monitor, warmup_steps=plan.warmup_iterations or 0,
                              metrics=rules(plan.task).results[:2]),
            # once per run, from the meter's window so far
            progress.InputBoundWarning(meter, plan.workers_per_rank, r.log, monitor, gpu_input=r.gpu_input is not None,
                                       shared_cache=rules(plan.task).shared_cache, inputs=r.inputs),
            # (loader.augment_on=gpu) the input's GPU time and its threads', read at its window's start and the end
            input_time,
            # last after each epoch: the ranks take rank 0's stop decision, after all of rank 0's work of the epoch
            h.AgreeToStop(r.comm, r.heartbeat),
        ]
        loop = TrainLoop(r.step, r.inputs, state, [x for x in hooks if x is not None], epochs=epochs,
                         steps_per_epoch=r.sampler.batches_per_epoch)
        started, first_epoch = time.time(), state.epoch
        r.log(f"training {epochs - state.epoch} epoch(s) x {loop.steps_per_epoch} step(s) per rank, batch "
              f"{plan.batch_per_rank} per rank"
              f"{f' ({plan.accumulate} micro-batches of {plan.micro_batch})' if plan.accumulate > 1 else ''}"
              f", global {plan.global_batch}, lr0 {plan.lr0:.6g}, warmup "
              f"{plan.warmup_iterations or 0} step(s), {plan.workers_per_rank} loader worker(s); "
              f"{len(r.train_dataset)} train / {len(r.val_loader.dataset)} val images; device {r.device}")
        loop.run()
        r.log(f"{state.epoch + 1 - first_epoch} epoch(s) in {(time.time() - started) / 60:.2f} min")
        if input_time is not None and input_time.line():
            r.detail(input_time.line())
        reports = _reports(r, meter, monitor, samples, input_time)
        if r.rank != 0:
            return None
        weights = r.folder.weights / ("best.pt" if (r.folder.weights / "best.pt").exists() else "last.pt")
        record = run_summary.summary(plan=plan, state=state, epochs=epochs, reports=reports, weights=weights,
                                     last=r.folder.weights / "last.pt", run_dir=folder.path, started=started)
        timeline.stamp("end")
        record["timeline"] = timeline.to_dict()
        record["checkpoint_write_s"] = [round(t, 3) for t in checkpointer.write_s]  # in the background, per save
        folder.write_json("summary.json", record)
        return record
    finally:
        r.close()


def bench_cell(cfg: dict, plan: LaunchPlan, folder: RunFolder) -> dict | None:
    """One ddp-bench cell: the training run's step and input pipeline, `bench.warmup_steps + bench.steps` steps
    metered (the sampler runs on across epochs; no validation, no checkpoint), then the same step on batches held on
    the device (the data-free ceiling: the task's own batches, its masks, keypoints or rotated boxes with them).
    Rank 0 writes cell.json with every rank's figures, and the task."""
    r = Rank(cfg, plan, folder, validation=False)
    plan = r.plan
    try:
        bench = r.settings.bench
        warmup, steps = int(bench.warmup_steps), int(bench.steps)
        # bench.profile on a GPU: the loop's steps right after the warm-up are profiled, and not measured
        profiled = PROFILED_STEPS if bench.profile and r.device.type == "cuda" else 0
        skip = warmup + profiled
        meter, monitor = _meter(r, skip)
        cpu = _HostCpu(skip, psutil.cpu_times)
        input_time = h.InputTime(r.gpu_input, r.inputs, skip) if r.gpu_input else None
        hooks = [
            h.Meter(meter, r.inputs, monitor),  # first: stamps the step's launch before any other host work
            h.Heartbeat(r.heartbeat),  # the watchdog sees each step done
            cpu,  # host CPU use from the end of the warm-up
            input_time,  # (loader.augment_on=gpu) the input's GPU time and its threads'
            h.StopOnSignal(r.comm, r.heartbeat, r.inputs, log=r.log),  # every rank agrees on a signal; nothing to save
            _BenchProgress(skip + steps, r.log) if r.rank == 0 else None,  # rank 0: a line every fifth of the steps
            # rank 0 (bench.profile): the steps after the warm-up profiled, then the meter pauses over them
            step_profile.ProfileSteps(warmup, profiled, folder.path, r.device, r.log, then=meter.pause)
            if profiled and r.rank == 0 else None,
        ]
        build.train_mode(r.net, r.frozen)
        loop = TrainLoop(r.step, r.inputs, r.state, [x for x in hooks if x is not None], epochs=1,
                         steps_per_epoch=skip + steps)
        loop.run()
        ceiling, ceiling_labels = _ceiling(r, int(bench.ceiling_batches), max(steps // 2, 10),
                                           profile=bool(bench.profile))
        rank_figures = {**run_summary.rank_report(rank=r.rank, device=r.device, meter=meter, monitor=monitor,
                                                  net=r.net, loss_items=r.step.loss_items, state=r.state,
                                                  input_gpu_ms=input_time.ms_per_image if input_time else None,
                                                  input_threads=input_time.threads if input_time else None),
                        "ceiling_images_per_s": ceiling, "ceiling_labels": ceiling_labels, "host_cpu": cpu.busy,
                        "whole_step_graph": isinstance(r.step, CapturedStep)}
        reports = r.comm.gather(rank_figures)
        if r.rank != 0:
            return None
        cell = {"mode": plan.mode, "size": plan.world_size * plan.devices_per_rank, "task": plan.task,
                "ranks": reports}
        folder.write_json("cell.json", cell)
        return cell
    finally:
        r.close()


# --- a training run's pieces -----------------------------------------------------------------------------------------
_EMA = object()


def _validate(r: Rank, plotter: Plotter | None, loop: TrainLoop, weights=_EMA):
    """Validate the EMA, or `weights` in its place (best.pt's: rank 0's, None on the other ranks). The final
    validation (the last epoch's, then best.pt's when it is another epoch) writes Ultralytics' plots, in rank 0's
    plotter thread once the weights are written (`plotter`: None on the other ranks)."""
    final = weights is not _EMA or loop.final_epoch
    kwargs = dict(device=r.device, data=r.data, amp=r.amp_dtype is not None, loss_items=r.step.loss_items or r.state.tloss,
                  epoch=r.state.epoch, epochs=loop.epochs, plots=final and bool(r.settings.train.plots),
                  per_class=weights is not _EMA)
    if kwargs["plots"] and plotter is not None:
        kwargs["draw"] = plotter.later
    if weights is _EMA:
        return r.validator.validate(r.ema, r.comm, **kwargs)
    return r.validator.validate_weights(weights, r.ema, r.comm, **kwargs)


def _best_weights(weights: Path, checkpointer):
    """best.pt's EMA weights, once the last epoch's write has ended (None without a best.pt)."""
    checkpointer.wait()  # the last epoch's write may still be under way
    best = weights / "best.pt"
    return checkpoint.ema_weights(checkpoint_io.load(best)) if best.exists() else None


def _layout(r: Rank, layout: checkpoint.Layout, early_stop: h.EarlyStop) -> dict:
    s = r.state
    epoch, step = s.position
    return layout.keys(scaler=r.scaler, epoch=epoch - 1 if step == 0 else epoch, best_fitness=s.best_fitness,
                       fitness=s.fitness, early_stop=early_stop.state_dict(), metrics=s.metrics,
                       results=results.read_columns(r.folder.path / "results.csv"))


def _strip(weights: Path, written: set[str]) -> None:
    """The final weights: last.pt and best.pt without training state (stripped here unless in `written`, the names
    the last save wrote as final weights); last.prev.pt removed."""
    last = weights / "last.pt"
    previous_of(last).unlink(missing_ok=True)
    for f in (last, weights / "best.pt"):
        if f.name not in written and f.exists():
            checkpoint.strip(f)


def _reports(r: Rank, meter, monitor, samples, input_time) -> list[dict]:
    """Every rank's figures on every rank; each rank also writes its own into ranks/rank<N>.json."""
    mine = run_summary.rank_report(rank=r.rank, device=r.device, meter=meter, monitor=monitor, net=r.net,
                                   loss_items=r.step.loss_items, state=r.state,
                                   samples=samples.seen if samples else None,
                                   input_gpu_ms=input_time.ms_per_image if input_time else None,
                                   input_threads=input_time.threads if input_time else None)
    r.folder.write_json(f"ranks/rank{r.rank}.json", mine)
    return r.comm.gather(mine)


# --- a training run's rank-0 hooks, each from the inputs it takes ---------------------------------------------------
def _rank0_timeline_edges(timeline: Timeline, inputs) -> Hook:
    return TimelineEdges(timeline, inputs)


def _rank0_train_batch_plots(plotter: Plotter, batches_per_epoch: int, close_at: int) -> Hook:
    return TrainBatchPlots(plotter, batches_per_epoch, close_at)


def _rank0_results_csv(run_dir: Path, metric_keys, lrs) -> Hook:
    return h.ResultsCsv(run_dir / "results.csv", metric_keys, lrs, label_loss_items)


def _rank0_tracking(integrations: list, run_dir: Path, r: Rank, plotter: Plotter | None,
                    figures: EpochFigures | None) -> Hook:
    """Ultralytics' integration callbacks over the run's hyperparameters, data, network and lrs; the plots they upload
    once drawn, and EpochFigures' latest."""
    return Tracking(list(integrations), run_dir=run_dir, hyp=r.hyp, data=r.data, net=r.net, lrs=r.schedule.lrs,
                    log=r.log, plots_drawn=plotter.drain if plotter else None,
                    figures=(lambda: figures.latest) if figures else None)


def _rank0_checkpoint(checkpointer, save_period: int, weights: Path, timeline: Timeline) -> Hook:
    """The checkpoint hook, its writes and the final weights timed for the timeline."""
    return Timed(h.Checkpoint(checkpointer, save_period, partial(_strip, weights)), timeline, name="save",
                 final="weights")


def _rank0_plots(plotter: Plotter, run_dir: Path, labels, names) -> Hook:
    return h.Plots(plotter, run_dir / "results.csv", labels, names)


# --- a bench cell's pieces -------------------------------------------------------------------------------------------
class _HostCpu(Hook):
    """Host CPU use over the measured steps (from the end of the warm-up to the last step)."""

    def __init__(self, warmup: int, cpu_times):
        self.warmup, self.cpu_times = warmup, cpu_times
        self.start = None
        self.busy = 0.0

    def before_step(self, loop: TrainLoop) -> None:
        if loop.ni == self.warmup:
            self.start = self.cpu_times()

    def after_train(self, loop: TrainLoop) -> None:
        if self.start is not None:
            self.busy = run_summary.host_cpu_busy(self.start, self.cpu_times())


class _BenchProgress(Hook):
    def __init__(self, total: int, log):
        self.total, self.log = total, log

    def after_step(self, loop: TrainLoop) -> None:
        if loop.ni % max(1, self.total // 5) == 0:
            self.log(f"bench step {loop.ni}/{self.total}")


def _ceiling(r: Rank, n_batches: int, steps: int, profile: bool) -> tuple[float, list[str]]:
    """images/s of the same step on `n_batches` real batches already on the device, cycled, and what their targets
    hold (batch_labels). The loader's workers stop first: still prefetching, they would compete with the step for
    the cores."""

    def sync():
        if r.device.type == "cuda":
            torch.cuda.synchronize(r.device)

    batches = r.inputs.batches_on_device(n_batches, first_ni=0)
    images, t0 = 0, 0.0
    for j in range(steps + 3):
        if j == 3:  # a few unmeasured steps after switching from the loader
            sync()
            t0 = time.perf_counter()
        r.step(batches[j % n_batches])
        images += len(batches[j % n_batches]["im_file"]) if j >= 3 else 0
    sync()
    ips = images / (time.perf_counter() - t0)
    if profile and r.rank == 0:
        _profile(r, batches, sync)
    return ips, batch_labels(batches[0])


def batch_labels(batch: dict) -> list[str]:
    """What a batch's targets hold, in words: boxes (rotated: with an angle), and masks or keypoints; a classifier's
    batch, no boxes: its images' classes."""
    if "bboxes" not in batch:
        return ["classes"]
    boxes = batch.get("bboxes")
    rotated = isinstance(boxes, torch.Tensor) and boxes.ndim == 2 and boxes.shape[1] == 5
    return ["rotated boxes" if rotated else "boxes"] + [k for k in ("masks", "keypoints") if k in batch]


def _profile(r: Rank, batches: list[dict], sync, steps: int = PROFILED_STEPS) -> None:
    """torch.profiler over a few data-free steps: where the step's time goes (bench.profile=true)."""

    with profile(activities=step_profile.activities(r.device)) as prof:
        for j in range(steps):
            r.step(batches[j % len(batches)])
        sync()
    step_profile.write(prof, r.folder.path, "profile", f"{steps} data-free steps, batch {r.plan.batch_per_rank}, "
                       f"{r.device}", steps, r.log)
