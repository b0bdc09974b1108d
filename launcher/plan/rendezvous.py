"""The rendezvous the ranks meet at: torchrun's standalone one on a single node, node 0's address and port across
nodes by hand, or the one a Slurm job decides."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.plan.checks import as_int
from launcher.problems import Problem

MULTI_NODE_DEFAULT_PORT = 29500  # torchrun's default; every node must agree on it, so it cannot be picked at random


@dataclass(frozen=True)
class Rendezvous:
    # standalone: torchrun's c10d on localhost:0, the kernel picks the port (also for one process: torchrun still
    # supervises it) | static: master_addr:master_port on every node | slurm: decided in the job (slurm_job.py)
    kind: str
    addr: str = ""
    port: int = 0


def rendezvous(dist: dict, top, on_slurm: bool, port_is_free, problems: list[Problem], notes: list[str]) -> Rendezvous:
    """The rendezvous for `top` (plan.py's topology), every problem with it added to `problems`."""
    requested = dist.get("master_port", "auto")
    addr = str(dist.get("master_addr") or "127.0.0.1")
    port = None
    if requested != "auto":
        port = as_int(requested, "dist.master_port", problems, 1)
        if port is not None and port > 65535:
            problems.append(Problem(f"dist.master_port={port}: a TCP port is 1..65535"))
            port = None
    if on_slurm:
        # decided in the job (slurm_job.py): c10d on the allocation's first host, a port derived from the job id
        # (or dist.master_port); one node: localhost:0. Nothing on this login node to check.
        return Rendezvous("slurm", "", port or 0)
    if top.nnodes > 1:
        if addr in ("127.0.0.1", "localhost", "::1"):
            problems.append(
                Problem(
                    f"nnodes={top.nnodes} needs dist.master_addr set to node 0's address, reachable from every node "
                    "(it is 127.0.0.1)"
                )
            )
        if port is None:
            port = MULTI_NODE_DEFAULT_PORT
            notes.append(f"multi-node: dist.master_port=auto means {port} on every node")
    elif port is None:
        return Rendezvous("standalone", "localhost", 0)
    if port_is_free is not None and top.node_rank == 0 and not port_is_free(port):
        problems.append(
            Problem(
                f"dist.master_port={port} is already in use on this machine (another job?). "
                "Pick another port, or leave dist.master_port=auto on a single node",
                environment=True,
            )
        )
    return Rendezvous("static", addr, port)
