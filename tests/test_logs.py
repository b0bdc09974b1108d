"""What reaches the console while ranks run (launch/logs.py): only what the rank logs gain, whole lines, in order,
filtered and prefixed as asked; a last line without a newline when the run ends; torchrun's stderr without the
traceback of a requested stop; how a stop is reported (launch/outcome.py). Fake files, no processes."""

from __future__ import annotations

import io
import signal

from launcher.launch import logs
from launcher.launch.logs import LogStreamer, QuietStop
from launcher.launch.outcome import report
from launcher.run_folder import RunFolder


def test_only_what_the_logs_gain_reaches_the_console_line_by_line(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_text("from an earlier attempt\n")  # a restarted rank appends to its log
    out = io.StringIO()
    streamer = LogStreamer([log], prefix=False, out=out)
    with open(log, "a") as f:
        f.write("epoch 1/2 step 2/4\nepoch 1/2 st")
    streamer.pump()
    assert out.getvalue() == "epoch 1/2 step 2/4\n"  # the half-written line waits for its end
    with open(log, "a") as f:
        f.write("ep 4/4\n")
    streamer.pump()
    assert out.getvalue() == "epoch 1/2 step 2/4\nepoch 1/2 step 4/4\n"


def test_every_ranks_lines_are_prefixed_with_their_rank_and_filtered(tmp_path):
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    out = io.StringIO()
    streamer = LogStreamer(logs, prefix=True, out=out, keep=lambda line: not line.startswith("noise"))
    logs[1].write_text("noise\nrank 1 here\n")  # a file that appears after the streamer started
    logs[0].write_text("rank 0 here\n")
    streamer.pump()
    assert sorted(out.getvalue().splitlines()) == ["[rank0] rank 0 here", "[rank1] rank 1 here"]


def test_diagnostics_stay_in_the_logs_unless_log_verbose_asks_for_them(tmp_path):
    """Lines a rank tags as diagnostics (run_folder.DETAIL: the attempt's header, timings, cores, CUDA graphs) are
    left off the console; log.verbose (or dist.debug) shows them. Warnings and the rest always reach it."""
    log = tmp_path / "rank0.log"
    lines = ["[detail] ==== rank 0/2 local_rank 0 pid 1 attempt 0 ====", "[rank 0] training 2 epoch(s)",
             "[rank 0] [detail] validation: 64 images in 0.26 s", "                   all         64        176",
             "[rank 0] WARNING input-bound: 40 % of step time waiting for data", "[rank 0] [detail] cores: 0-3"]
    shown = {}
    for verbose in (False, True):
        log.write_text("")
        out = io.StringIO()
        streamer = LogStreamer([log], prefix=False, out=out, verbose=verbose)
        log.write_text("\n".join(lines) + "\n")
        streamer.pump()
        shown[verbose] = out.getvalue().splitlines()
    assert shown[False] == [lines[1], lines[3], lines[4]]
    assert shown[True] == lines
    assert logs.verbose_console({"log": {"verbose": True}, "dist": {"debug": False}})
    assert logs.verbose_console({"log": {"verbose": False}, "dist": {"debug": True}})
    assert not logs.verbose_console({"log": {"verbose": False}, "dist": {"debug": False}})


def test_the_launchers_diagnostics_go_to_its_log_and_to_the_console_with_verbose(tmp_path, capsys):
    launcher_log = RunFolder(tmp_path / "run").launcher_log
    logs.note("compiling the ranks' bytecode", launcher_log, verbose=False)
    assert capsys.readouterr().out == ""
    logs.note("compiling again", launcher_log, verbose=True)
    assert capsys.readouterr().out == "compiling again\n"
    assert launcher_log.read_text() == "compiling the ranks' bytecode\ncompiling again\n"


def test_a_last_line_without_a_newline_is_shown_when_the_run_ends(tmp_path):
    log = tmp_path / "rank0.log"
    out = io.StringIO()
    streamer = LogStreamer([log], prefix=False, out=out, period=0.01)
    streamer.start()
    log.write_text("done: 2 epoch(s)\nTraceback (most recent call last): cut off")
    streamer.stop()
    assert out.getvalue() == "done: 2 epoch(s)\nTraceback (most recent call last): cut off\n"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def progress(epoch: int, step: int, steps: int = 4, eta: str = "eta epoch 0:02, run 0:10") -> str:
    return f"[rank 0] epoch {epoch}/2 step {step}/{steps} | loss box 1.5 cls 2 | 20.0 img/s, data wait 1% | lr 0.01 | {eta}"


def test_on_a_terminal_rank_0s_progress_is_a_bar_per_epoch_and_other_lines_print_above_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    log = tmp_path / "rank0.log"
    log.write_text("")
    out = Terminal()
    streamer = LogStreamer([log], prefix=False, out=out)
    assert streamer.bar is not None
    lines = ["[rank 0] training 2 epoch(s)", progress(1, 2), progress(1, 4), "[rank 0] closing mosaic", progress(2, 2)]
    log.write_text("\n".join(lines) + "\n")
    streamer.pump()
    streamer.bar.close()
    shown = out.getvalue()
    assert "[rank 0] training 2 epoch(s)" in shown and "[rank 0] closing mosaic" in shown
    assert "epoch 1/2" in shown and "4/4" in shown and "epoch 2/2" in shown and "eta epoch 0:02, run 0:10" in shown
    assert "step 2/4 |" not in shown  # drawn as a bar, not printed as the line


def test_in_a_file_under_slurm_or_for_every_rank_the_lines_stay_lines(tmp_path, monkeypatch):
    log = tmp_path / "rank0.log"
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert LogStreamer([log], prefix=False, out=io.StringIO()).bar is None  # not a terminal
    assert LogStreamer([log], prefix=True, out=Terminal()).bar is None  # every rank's lines
    monkeypatch.setenv("SLURM_JOB_ID", "12345")
    assert LogStreamer([log], prefix=False, out=Terminal()).bar is None  # a job's output is a file


def test_the_time_left_counts_steps_at_their_mean_time_and_the_epoch_boundaries():
    from launcher.rank.run.progress import Eta, clock_text

    t = [0.0]
    eta = Eta(clock=lambda: t[0])
    eta.epoch_started()
    t[0] = 10.0
    eta.step_done()  # the first step: workers starting, not counted
    assert eta.left(steps_in_epoch=3, steps_after=4, epochs_after=1) is None
    for _ in range(3):
        t[0] += 2.0
        eta.step_done()
    eta.epoch_ended()
    t[0] += 7.0  # validation and the next epoch's first step
    eta.epoch_started()
    eta.step_done()
    assert eta.boundary_s == 7.0
    assert eta.left(steps_in_epoch=3, steps_after=4, epochs_after=1) == (6.0, 6.0 + 8.0 + 7.0)
    assert [clock_text(s) for s in (7, 125, 3723)] == ["0:07", "2:05", "1:02:03"]


def test_colour_codes_reach_neither_the_rank_logs_nor_the_failure_records(tmp_path):
    """Ultralytics colours its messages (colorstr) whatever the stream: the log file and summary.json's root cause
    keep the words, not the escape codes."""
    from launcher.rank.worker import PlainTextFile
    from launcher.run_folder import RunFolder

    log = tmp_path / "rank0.log"
    with open(log, "wb") as raw:
        out = PlainTextFile(raw)
        out.write("\x1b[34m\x1b[1mtrain: \x1b[0mScanning labels\n")
        out.flush()
    assert log.read_text() == "train: Scanning labels\n"

    folder = RunFolder(tmp_path / "run")
    folder.record_failure(0, "FileNotFoundError: \x1b[34m\x1b[1mval: \x1b[0mError loading data", phase="train",
                          detail="Traceback ...\n\x1b[31mboom\x1b[0m")
    folder.write_outcome("failed", 1, "training failed")
    text = folder.summary_file.read_text()
    assert "\\u001b" not in text and "\x1b" not in text
    assert folder.summary()["root_cause"]["error"] == "FileNotFoundError: val: Error loading data"


# torchrun's stderr when the launcher stops it: its own lines, then the traceback of the SignalException it raises.
STOPPED_TORCHRUN = """W1201 14:57:23.853000 28729 torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, shutting down workers
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 28729 got signal: 15
"""
FAILED_TORCHRUN = """Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1138, in main
    run(args)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
launcher.rank.worker FAILED
"""


def test_a_stopped_torchrun_shows_its_lines_but_not_its_signal_traceback():
    out = io.StringIO()
    QuietStop(out).copy(io.BytesIO((STOPPED_TORCHRUN + FAILED_TORCHRUN).encode()))
    assert out.getvalue() == STOPPED_TORCHRUN.splitlines(keepends=True)[0] + FAILED_TORCHRUN  # a failure stays whole


class DeadConsole(io.StringIO):
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")  # what a closed terminal or pipe does to every write


def test_a_dead_console_never_stops_the_copy_of_torchruns_stderr(monkeypatch):
    gone = []
    monkeypatch.setattr(logs, "console_gone", gone.append)
    pipe = io.BytesIO(b"line\n" * 1000)
    QuietStop(DeadConsole()).copy(pipe)
    assert pipe.tell() == len(b"line\n" * 1000) and gone  # all read: torchrun never blocks on a full pipe


def stopped_folder(tmp_path, with_checkpoint: bool) -> RunFolder:
    folder = RunFolder(tmp_path / "run")
    (folder.path / "logs").mkdir(parents=True)
    if with_checkpoint:
        folder.weights.mkdir()
        (folder.weights / "last.pt").write_bytes(b"x")
    return folder


def test_a_stop_says_where_the_checkpoint_is_and_how_to_continue(tmp_path, capsys):
    folder = stopped_folder(tmp_path, with_checkpoint=True)
    assert report(folder, 1, signal.SIGINT, 0) == 130
    out = capsys.readouterr().out
    assert f"the last checkpoint is {folder.weights / 'last.pt'}. Continue with: ddp-launch resume={folder}" in out
    assert folder.summary()["status"] == "stopped"


def test_a_stop_before_the_first_checkpoint_points_to_what_exists_not_to_weights(tmp_path, capsys):
    folder = stopped_folder(tmp_path, with_checkpoint=False)
    assert report(folder, 1, signal.SIGINT, 0) == 130
    out = capsys.readouterr().out
    assert "weights" not in out.replace("no weights", "")  # no weights/ folder to point to
    assert f"before the first checkpoint; {folder} holds the run's config, plan and logs" in out
    assert f"Start it from its first step with: ddp-launch resume={folder}" in out
    assert "before the first checkpoint" in folder.summary()["detail"]


# torchrun signalled twice (SLURM signals every process of the step; the launcher forwards its own): the second
# SignalException interrupts torchrun's shutdown, chained to the first.
CHAINED_STOP = STOPPED_TORCHRUN + """
During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 885, in _close
    proc.join(time_to_wait)
KeyError: 30
"""


def test_a_torchrun_signalled_twice_shows_no_fragment_of_its_chained_tracebacks():
    out = io.StringIO()
    QuietStop(out).copy(io.BytesIO((CHAINED_STOP + FAILED_TORCHRUN).encode()))
    assert out.getvalue() == STOPPED_TORCHRUN.splitlines(keepends=True)[0] + FAILED_TORCHRUN
    out = io.StringIO()
    QuietStop(out).copy(io.BytesIO(CHAINED_STOP.encode()))  # the chain at the very end of the stream too
    assert out.getvalue() == STOPPED_TORCHRUN.splitlines(keepends=True)[0]
