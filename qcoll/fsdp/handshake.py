"""Every rank calls ``quantize_comm``, with the same arguments: checked through the store.

The quantized collectives check their frames, but a rank that never called
``quantize_comm`` runs FSDP2's own collectives, which check nothing, on other process
groups: the two sides would only meet the transport's timeout, with no word of why.
So ``quantize_comm`` writes a fingerprint of its arguments and of the model's FSDP
groups through :class:`qcoll.comm.agreement.Agreement` (no collective is issued, so
nothing can pair up with FSDP2's) and reads every rank's.
"""
from __future__ import annotations

import datetime

from ..comm.agreement import Agreement

AGREEMENT = Agreement("quantize_comm")


def agree(fingerprint: dict, timeout: datetime.timedelta | None = None) -> None:
    """Wait (up to ``timeout``, default the store's) until every rank has written its fingerprint (the
    arguments and the model's FSDP groups, by name) for this call; a ``RuntimeError`` naming the ranks
    that did not, a ``ValueError`` (on every rank) naming the ranks and the fields that differ from rank 0's."""
    AGREEMENT.same_fields({k: repr(v) for k, v in fingerprint.items()}, timeout, missing_hint=(
        "Every rank must call quantize_comm on its model, in the same order, before the first forward; ranks "
        "that do not run FSDP2's own collectives and cannot meet the quantized ones"))
