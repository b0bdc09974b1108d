"""TCP port checks for the rendezvous.

A single node with `dist.master_port=auto` never picks a port here: torchrun's standalone rendezvous binds
localhost:0 and the kernel hands out a free port atomically, so concurrent launches cannot race. An explicit port is
checked before any process starts, so a clash is an error naming the port instead of a hang or an EADDRINUSE deep
inside torch.
"""

from __future__ import annotations

import errno
import socket


def port_is_free(port: int, host: str = "") -> bool:
    """True when nothing listens on `port` (checked on every interface unless `host` is given).

    NOTE: this is a check, not a reservation: another process can still take the port between this call and the
    moment torchrun binds it. Only the standalone rendezvous (port 0) is race-free.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers of a finished run are fine
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True

