"""A node that never joins a multi-node launch by hand is named while node 0 waits, and the launch is refused in one
line after dist.timeout_s, not after torchrun's 600 s with a DistStoreError traceback."""

from __future__ import annotations

import io
import socket
import time

import pytest

from launcher.launch.logs import QuietStop
from launcher.launch.torchrun import local_command, rendezvous_wait
from tests.conftest import TINY, ddp_launch
from tests.test_plan import plan_for

# torchrun's stderr when the static rendezvous times out on node 0 (its C++ retry lines come first on other nodes).
NOT_JOINED = """Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py", line 528, in _rendezvous
    rdzv_info = spec.rdzv_handler.next_rendezvous()
                ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py", line 67, in next_rendezvous
    self._store = TCPStore(  # type: ignore[call-arg]
                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
torch.distributed.DistStoreError: Timed out after 11 seconds waiting for clients. 1/2 clients joined.
"""
RETRY = """[E1206 18:14:47.627186839 socket.cpp:1028] [c10d] The client socket has timed out after 5000ms while trying to connect to (vm, 29611).
Exception raised from throwTimeoutError at socket.cpp:1030 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f1d56cb46 in libc10.so)
<omitting python frames>
frame #45: _start + 0x21 (0x55e18cb39081 in python3)

"""


def two_nodes(node_rank: int):
    plan, problems = plan_for(["gpus=0", "nproc=1", "nnodes=2", f"node_rank={node_rank}", "dist.master_addr=10.0.0.1",
                               "dist.master_port=29400", "dist.timeout_s=30"])
    assert not problems
    return plan


def test_the_rendezvous_of_nodes_started_by_hand_waits_dist_timeout_s_and_says_for_whom():
    node0, node1 = two_nodes(0), two_nodes(1)
    assert local_command(node0, "/r")[local_command(node0, "/r").index("--rdzv-conf") + 1] == "timeout=30"
    waiting, refusal = rendezvous_wait(node0)
    assert waiting == "waiting for node 1 of 2 at 10.0.0.1:29400 (at most dist.timeout_s=30 s)"
    assert "node 1 of 2 did not join at 10.0.0.1:29400 within dist.timeout_s=30 s" in refusal
    waiting, refusal = rendezvous_wait(node1)
    assert "waiting for node 0 at 10.0.0.1:29400" in waiting and "node 0 of 2 did not answer" in refusal
    one_node, _ = plan_for(["gpus=0", "nproc=2"])
    assert rendezvous_wait(one_node) is None


def test_a_rendezvous_timeout_is_one_line_and_any_other_traceback_stays_whole():
    out = io.StringIO()
    stop = QuietStop(out, rendezvous_refusal="ddp-launch: refused: node 1 of 2 did not join")
    stop.copy(io.BytesIO((RETRY + NOT_JOINED).encode()))
    assert stop.refused
    assert out.getvalue().strip() == ("ddp-launch: refused: node 1 of 2 did not join (Timed out after 11 seconds "
                                      "waiting for clients. 1/2 clients joined.)")
    out = io.StringIO()
    QuietStop(out).copy(io.BytesIO(NOT_JOINED.encode()))  # a single node has no refusal to give: shown as it is
    assert out.getvalue() == NOT_JOINED


@pytest.mark.slow
@pytest.mark.dist
def test_node_0_names_the_absent_node_and_is_refused_in_one_line_after_dist_timeout_s(tmp_path, cache_dir):
    with socket.socket() as s:  # a free port for the store node 0 serves
        s.bind(("", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    r = ddp_launch(["gpus=0", "nproc=1", "nnodes=2", "node_rank=0", f"dist.master_addr={socket.gethostname()}",
                    f"dist.master_port={port}", "dist.timeout_s=3", "train.epochs=1", *TINY],
                   cwd=tmp_path, timeout=300)
    took = time.monotonic() - started
    console = r.stdout + r.stderr
    assert r.returncode == 2, console
    assert f"waiting for node 1 of 2 at {socket.gethostname()}:{port} (at most dist.timeout_s=3 s)" in console
    refusals = [line for line in console.splitlines() if "refused: node 1 of 2 did not join" in line]
    assert len(refusals) == 1 and "Traceback" not in console and "DistStoreError" not in console, console
    assert took < 120, took  # the plan, torchrun's start and 3 s: not torchrun's own 600 s
