"""Shared inputs for the codec tests (CUDA kernels, host helpers, the CPU fast paths): random rows with
the awkward blocks, values at their block's absmax."""
from __future__ import annotations

import pytest
import torch

#: ``pytestmark`` of the tests that need a GPU: marked ``cuda``, skipped with the reason without one.
NEEDS_GPU = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

def world_of_one():
    """A generator for a module fixture: a world of one rank in this process on the
    ``cpu:gloo,cuda:nccl`` backend (CPU tensors through gloo, CUDA ones through NCCL); yields
    its ``qcoll.Topology(1)`` and destroys the group afterwards."""
    import datetime
    import socket

    import torch.distributed as dist

    import qcoll

    pytest.importorskip("cupy")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 0))
    yield qcoll.Topology(1)
    dist.destroy_process_group()


BITS = (8, 6, 4, 2)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def awkward_rows(rows: int, n: int, block: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random ``[rows, n]`` with a zero block, NaN / +Inf / -Inf blocks, a subnormal block,
    a huge block (fp32) and a -0.0 element, wherever the shape has room for them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 2)
    nb = -(-n // block)
    specials = []
    for r in range(rows):
        for b in range(nb):
            specials.append((r, b))
    kinds = ["zero", "nan", "inf", "ninf", "tiny", "huge", "negzero"]
    for (r, b), kind in zip(specials[1::2], kinds):
        sl = slice(b * block, min(n, (b + 1) * block))
        if kind == "zero":
            x[r, sl] = 0
        elif kind == "nan":
            x[r, sl.start] = float("nan")
        elif kind == "inf":
            x[r, sl.stop - 1] = float("inf")
        elif kind == "ninf":
            x[r, sl.start] = float("-inf")
        elif kind == "tiny":
            if dtype == torch.float32:  # deep subnormal: inv overflows, scale may underflow
                x[r, sl] = torch.randint(-3, 4, (sl.stop - sl.start,), generator=g).float() * 1.401298464324817e-45
            else:
                x[r, sl] = x[r, sl] * 1e-6
        elif kind == "huge" and dtype == torch.float32:
            x[r, sl] = x[r, sl].sign() * 3.4028234663852886e38
        elif kind == "negzero":
            x[r, sl.start] = -0.0
    return x.to(dtype)


def values_at_absmax(nb: int, block: int, seed: int) -> torch.Tensor:
    """fp32 ``[1, nb * block]``: ``nb`` blocks whose absmax spans the exponent range where 1/scale is
    finite, each block's first values at and just below +-absmax (and 0.5, 0), the rest random below it."""
    g = torch.Generator().manual_seed(seed)
    absmax = torch.exp2(torch.empty(nb, 1).uniform_(-120, 127, generator=g)) * torch.rand(nb, 1, generator=g).add_(1)
    absmax = absmax.clamp(max=3.4e38)
    frac = torch.rand(nb, block, generator=g)
    frac[:, :8] = torch.tensor([1.0, -1.0, 1 - 2**-24, -(1 - 2**-24), 1 - 2**-23, 0.5, -0.5, 0.0])
    return (absmax * frac).reshape(1, -1)
