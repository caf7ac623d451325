"""Which peer died: the ranks' processes (host and pid), as every rank told the others when the
:class:`~qcoll.Topology` was built, and a look at them when the transport fails.

gloo reports a dead peer as "Connection closed by peer [address]:port", which names neither the
rank nor the process. A survivor can check the processes of the group's ranks that run on its own
host (a pid that is gone, or a zombie, is dead); ranks on other hosts can only be listed.
"""
from __future__ import annotations

import os
import socket
import time

#: seconds a survivor looks again when every local peer still seems to run: a killed peer's sockets close
#: while the kernel tears the process down, so the transport can fail before the process shows as gone
GRACE_S = 1.0

#: global rank -> (host, pid), from the last Topology's agreement (empty before one was built)
_processes: dict[int, tuple[str, int]] = {}


def me() -> dict:
    """This process, as the agreement carries it."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def record(every: dict) -> None:
    """Keep ``{rank: {"host": ..., "pid": ...}}`` (every rank's :func:`me`)."""
    _processes.clear()
    _processes.update({int(r): (str(p["host"]), int(p["pid"])) for r, p in every.items()})


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:      # a killed child not yet reaped is a zombie: dead
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(ranks) -> str:
    """One sentence on the processes of ``ranks`` (global ranks of the failed group, this rank
    left out): which of them on this host are no longer running, and which could not be checked."""
    host = socket.gethostname()
    ranks = [r for r in ranks if _processes.get(r) != (host, os.getpid())]
    known = [r for r in ranks if r in _processes]
    if not known:
        return f"The group's other ranks are {ranks}; build a qcoll.Topology first for a check of which died."
    local = [r for r in known if _processes[r][0] == host]
    dead = [r for r in local if not _running(_processes[r][1])]
    deadline = time.monotonic() + GRACE_S
    while local and not dead and time.monotonic() < deadline:
        time.sleep(0.05)
        dead = [r for r in local if not _running(_processes[r][1])]
    remote = [r for r in ranks if r not in local]
    parts = []
    if dead:
        parts.append("rank " + ", rank ".join(f"{r} (pid {_processes[r][1]})" for r in dead)
                     + f" {'is' if len(dead) == 1 else 'are'} no longer running on this host: "
                     f"{'it' if len(dead) == 1 else 'they'} died, and {'its' if len(dead) == 1 else 'their'} "
                     f"own log or exit status says why")
    alive = [r for r in local if r not in dead]
    if alive:
        parts.append(f"ranks {alive} still run on this host")
    if remote:
        parts.append(f"ranks {remote} run on other hosts (not checked: one of them, or the link to it, may have failed)")
    return "Of the group's other ranks: " + "; ".join(parts) + "."
