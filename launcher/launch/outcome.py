"""How a run ends, as the launcher says it: the result, or what stopped it, and which rank failed first."""

from __future__ import annotations

import signal

from launcher.inputs import labels
from launcher.launch.logs import say
from launcher.plan.task_rules import rules
from launcher.run_folder import RunFolder


def report(folder: RunFolder, code: int, signum: int | None, node_rank: int) -> int:
    """Print the outcome of torchrun on this node; a failed or stopped run gets its summary.json. Returns the
    launcher's exit code: 0, torchrun's code, or 128 + the signal that stopped it."""
    summary = folder.summary() or {}
    finished = summary.get("status") == "finished"
    if signum is not None and not finished:
        name, last = signal.Signals(signum).name, folder.weights / "last.pt"
        if last.is_file():
            detail = f"stopped by {name}; the last checkpoint is {last}"
            say(f"\nddp-launch: {detail}. Continue with: ddp-launch resume={folder}")
        else:  # stopped before its first checkpoint: there is no weights/ to point to
            detail = (f"stopped by {name} before the first checkpoint; {folder} holds the run's config, plan and "
                      f"logs, no weights")
            say(f"\nddp-launch: {detail}. Start it from its first step with: ddp-launch resume={folder}")
        folder.write_outcome("stopped", 128 + signum, detail)
        return 128 + signum
    if code != 0 and not finished:
        detail = f"training failed (torchrun exit code {code}); rank logs in {folder.logs}"
        say(f"\nddp-launch: {detail}")
        for i, fail in enumerate(folder.write_outcome("failed", code, detail)):
            say(f"  {'root cause' if i == 0 else 'then'}: rank {fail['rank']}: {fail['error']}")
        return code
    if not finished:
        if node_rank != 0:
            say("\nddp-launch: this node's ranks finished; rank 0 writes the summary on node 0")
            return 0
        say(f"\nddp-launch: the ranks exited without writing {folder.summary_file}")
        return 1
    s = summary
    say(
        f"\ndone: {s['epochs_completed']} epoch(s) on {s['world_size']} rank(s), global batch {s['global_batch']}, "
        f"lr0 {s['lr0']:.6g}, {_speed_text(s)}"
    )
    say(rules(s.get("task")).result_line(s))  # its metrics: the boxes' and the task's own, or a classifier's accuracy
    for split, check in (s.get("images") or {}).items():
        for line in labels.describe(split, check):
            say(f"data        {line}")
    say(f"weights     {s['weights']}")
    say(f"run folder  {folder}")
    return 0


def _speed_text(s: dict) -> str:
    """The steady-state rate, or why there is none: every step of a short run fell in the meter's warm-up."""
    if s.get("images_per_s") is None:
        return "too short for a steady-state images/s (each rank's first steps are warm-up, left out of it)"
    return f"{s['images_per_s']:.1f} images/s (steady state)"


def say_finished(folder: RunFolder) -> None:
    s = folder.summary() or {}
    task = rules(s.get("task"))
    headline = next((m for m in task.results if m.key == s.get("headline")), task.headline)  # summary.json names it
    say(f"{folder} already finished: {s.get('epochs_completed')} epoch(s), {headline.words} "
        f"{s.get(headline.key, 0.0):.4f}; nothing to resume")
    say(f"weights     {s.get('weights')}")
