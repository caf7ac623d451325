"""Errors the collectives raise when ranks disagree, and context for the transport's own errors."""
from __future__ import annotations


class RankMismatchError(ValueError):
    """Ranks of one collective passed different arguments (sizes, bits, block size).

    Raised on every rank that received data it cannot decode as what it expects
    (a frame header that disagrees with its own arguments, see docs/FORMAT.md
    "Frames"), and by the ``QCOLL_DEBUG=1`` metadata check. ``op`` names the
    collective, ``rank`` is this rank, ``peer`` the global rank whose data
    disagreed (None when the debug check reports all ranks), ``expected`` and
    ``got`` the two frame headers when one was compared (else None).
    """

    def __init__(self, message: str, op: str, rank: int, peer: int | None = None, expected=None, got=None):
        super().__init__(message)
        self.op, self.rank, self.peer = op, rank, peer
        self.expected, self.got = expected, got


def add_transport_context(error: BaseException, op: str, rank: int, sent: str, peers: str = "") -> BaseException:
    """Note on a transport error (gloo's connection reset, timeout) what this rank was doing.

    A peer that passed a larger size makes gloo abort the process that receives it
    ("Received data size doesn't match expected size"); its peers then see the
    connection close. The note names the collective and this rank's frame so the
    two logs can be matched, and ``peers``: which ranks of the group died, where that
    could be checked (:func:`qcoll.comm.liveness.describe`). Python < 3.11 has no notes:
    the error is unchanged.
    """
    if hasattr(error, "add_note"):
        error.add_note(f"qcoll {op} on rank {rank} failed in the transport while sending {sent}. {peers} If a peer "
                       f"aborted with \"Received data size doesn't match expected size\", ranks passed different "
                       f"sizes, bits or block sizes (QCOLL_DEBUG=1 compares them before communicating).")
    return error
