"""What reaches the console while ranks run (launch/logs.py): only what the rank logs gain, whole lines, in order,
filtered and prefixed as asked; a last line without a newline when the run ends. Fake files, no processes."""

from __future__ import annotations

import io

from launcher.launch.logs import LogStreamer


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


def test_a_last_line_without_a_newline_is_shown_when_the_run_ends(tmp_path):
    log = tmp_path / "rank0.log"
    out = io.StringIO()
    streamer = LogStreamer([log], prefix=False, out=out, period=0.01)
    streamer.start()
    log.write_text("done: 2 epoch(s)\nTraceback (most recent call last): cut off")
    streamer.stop()
    assert out.getvalue() == "done: 2 epoch(s)\nTraceback (most recent call last): cut off\n"
