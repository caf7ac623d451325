"""Run a benchmark function on N local gloo ranks, or on the ranks torchrun started.

Signals. A Ctrl-C in a terminal sends SIGINT to the whole foreground process
group, workers included. The workers therefore ignore SIGINT (they inherit the
ignored disposition from the moment they are started, so even a worker still
importing torch prints no traceback); the parent alone turns it into
``KeyboardInterrupt``, stops every worker (SIGTERM, then SIGKILL after a grace
period), waits for them, and re-raises. SIGTERM to the parent does the same and
raises :class:`Terminated`. Workers also get SIGKILL if the parent dies
(``PR_SET_PDEATHSIG``), so no rank outlives the command.

Exit. A rank that finished cleanly ends with ``os._exit(0)`` once every rank is done
(:func:`_settle`) and its standard streams are flushed (:func:`_exit_clean`). Otherwise gloo's
threads (each process group's, ``qcoll.Topology``'s subgroups included, which
``destroy_process_group`` does not stop while Python objects still hold the groups) meet the
interpreter's and C++'s teardown, and a rank that had finished can die in ``std::terminate``
("terminate called without an active exception"). A rank that raised
keeps its traceback and exit code (the normal exit path).
"""
from __future__ import annotations

import ctypes
import datetime
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GRACE_S = 5.0


class RankFailed(RuntimeError):
    """A spawned rank raised or died; ``detail`` is its traceback or exit status."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed: {detail}")
        self.rank = rank
        self.detail = detail


class Terminated(Exception):
    """The parent received SIGTERM; the workers have been stopped."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _quiet() -> None:
    """Drop torch's per-call deprecation notices for ``*_into_tensor``/``*_tensor`` collectives (torch >= 2.13)."""
    warnings.filterwarnings("ignore", message=r".* is deprecated\. Please use .*_single.* instead",
                            category=FutureWarning)


def _entry(rank, world, port, ranks_per_node, fn, args, addr):
    _quiet()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent handles Ctrl-C (module docstring)
    _die_with_parent()                               # torch's own death signal is SIGINT, ignored here
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        fn(args)
        _settle()
    except BaseException:
        dist.destroy_process_group()
        raise               # torch.multiprocessing records the traceback, the rank exits with 1
    _exit_clean()


def _settle() -> None:
    """Wait until every rank is done before any exits: a rank that leaves while a peer's
    gloo threads still talk to it can make that peer fail."""
    dist.barrier()


def _exit_clean():
    """End this rank now, as a clean finish: flush what it wrote, then ``os._exit`` (module
    docstring), skipping the teardown that races gloo's threads. Exit code 0, or 120 (as
    Python's own exit) when stdout or stderr cannot be flushed, so a lost result is no success.
    Results written to files must be closed by then (``with`` / ``write_atomic``)."""
    code = 0
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:
            code = 120
    os._exit(code)


def _is_the_command() -> bool:
    """Whether this process is ``qcoll-bench`` itself (``python -m qcoll.bench`` or the console
    script), whose ``main`` ends when ``run_ranks`` returns, rather than a program that called
    ``run_ranks`` and goes on (a test calling ``cli.main`` in its own process)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "qcoll.bench.__main__" or \
        os.path.basename(sys.argv[0] if sys.argv else "") == "qcoll-bench"


def _stop(processes) -> None:
    """SIGTERM every live worker, SIGKILL those still alive after ``GRACE_S``, reap all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(GRACE_S)
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def _root_cause(ctx, rank: int, detail: str) -> tuple[int, str]:
    """The failed rank to report: the first one whose error is not just a peer's dropped connection.

    When one rank raises, the others often fail too, with gloo's "Connection closed by peer",
    and whichever exits first is the one ``join`` saw.
    """
    traces = {rank: detail}
    for i, path in enumerate(getattr(ctx, "error_files", [])):
        if i != rank and os.access(path, os.R_OK):
            try:
                with open(path, "rb") as f:
                    traces[i] = pickle.load(f).strip()
            except Exception:
                pass
    secondary = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    causes = [i for i in sorted(traces) if not any(m in (traces[i].splitlines() or [""])[-1] for m in secondary)]
    chosen = causes[0] if causes else rank
    others = sorted(set(traces) - {chosen})
    note = f"\n(ranks {others} failed as well)" if others else ""
    return chosen, traces[chosen] + note


def _on_sigterm(signum, frame):
    raise Terminated()


def _set_signal(signum, handler):
    """``signal.signal`` where allowed (main thread); returns the previous handler or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signum, handler)


def _restore_signal(signum, previous) -> None:
    if previous is not None:
        signal.signal(signum, previous)


def run_ranks(fn, args, nproc: int | None, ranks_per_node: int, addr: str = "127.0.0.1") -> None:
    """Call ``fn(args)`` on every rank with the default group initialized.

    Under torchrun (``RANK`` set and no ``nproc``) the current process is one
    rank; otherwise ``nproc`` workers are spawned on this host. A rank that finishes
    cleanly exits with :func:`_exit_clean` (module docstring): the spawned workers always,
    the current process under torchrun when it is ``qcoll-bench`` itself (then this call
    does not return; every subcommand returns 0 right after it anyway). ``fn`` and
    ``args`` must pickle (a module-level function, an ``argparse.Namespace``).

    Raises :class:`RankFailed` when a worker fails (the others are stopped),
    ``KeyboardInterrupt`` on Ctrl-C and :class:`Terminated` on SIGTERM, in both
    cases only after every worker has exited.
    """
    if "RANK" in os.environ and nproc is None:
        _quiet()
        dist.init_process_group("gloo")
        try:
            fn(args)
            _settle()
        except BaseException:
            dist.destroy_process_group()
            raise
        if _is_the_command():
            _exit_clean()
        dist.destroy_process_group()
        return
    world = nproc or 1
    port = _free_port()
    previous_int = _set_signal(signal.SIGINT, signal.SIG_IGN)   # inherited by the workers
    try:
        ctx = mp.start_processes(_entry, args=(world, port, ranks_per_node, fn, args, addr), nprocs=world,
                                 join=False, start_method="spawn")
    finally:
        _restore_signal(signal.SIGINT, previous_int)
    previous_term = _set_signal(signal.SIGTERM, _on_sigterm)
    try:
        while not ctx.join(timeout=0.5):
            pass
    except mp.ProcessRaisedException as e:   # join() has already stopped the other workers
        rank, detail = _root_cause(ctx, e.error_index,
                                   e.args[0].split("terminated with the following error:\n", 1)[-1].strip())
        raise RankFailed(rank, detail) from None
    except mp.ProcessExitedException as e:
        raise RankFailed(e.error_index, f"exited with {e.signal_name or f'code {e.exit_code}'}") from None
    except BaseException:
        _stop(ctx.processes)
        raise
    finally:
        _restore_signal(signal.SIGTERM, previous_term)
