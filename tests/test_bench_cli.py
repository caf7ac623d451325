"""CLI smoke tests of ``qcoll-bench collectives`` on 4 local gloo ranks (2 emulated nodes x 2).

One tiny sweep (``python -m qcoll.bench`` in a subprocess) is shared by the
schema, timing, byte and error checks. The expected wire bytes are derived here
from the wire format (DESIGN.md, docs/FORMAT.md) and the byte-accounting rule,
not from anything the benchmark prints.
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from qcoll.bench import cli, collectives, progress

W, L = 4, 2                      # world, ranks per node
N = W // L                       # nodes
SIZES = [1024, 3072, 9216]       # --min 1K --max 9K --factor 3: 64, 192, 576 elements per rank
CHUNKS = 3
WEIGHT_BLOCK, GRAD_BLOCK = 256, 128   # DESIGN.md defaults for weights and gradients
HEADER = 16                      # the frame header in front of each quantized buffer sent (docs/FORMAT.md "Frames")
slow = pytest.mark.slow   # the tests that start 4 ranks or a subprocess
BAR = re.compile(rb"qcoll-bench: +\d+%\|")   # the progress bar as drawn (tqdm, qcoll.bench.progress.FORMAT)


def _env(**extra):
    """The environment of a ``python -m qcoll.bench`` subprocess.

    The subprocesses run in a fresh temporary directory, never the repository root, where
    ``-m`` would import the source tree's ``qcoll/`` over the installed package.
    """
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    env.update(extra)
    return env


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    argv = ["collectives", "--nproc", str(W), "--ranks-per-node", str(L), "--min", "1K", "--max", "9K",
            "--factor", "3", "--iters", "2", "--warmup", "1", "--chunks", str(CHUNKS), "--header-cost",
            "--json", str(d / "out.json")]
    if _has_matplotlib():
        argv += ["--plot", str(d / "bw.png")]
    p = subprocess.run([sys.executable, "-m", "qcoll.bench", *argv], capture_output=True, text=True, timeout=180,
                       cwd=d, env=_env(QCOLL_PROGRESS="0"))
    assert p.returncode == 0, p.stderr
    with open(d / "out.json") as f:
        doc = json.load(f)
    return {"doc": doc, "rows": doc["rows"], "stdout": p.stdout, "stderr": p.stderr, "dir": d}


def packed_nbytes(n: int, bits: int, block: int) -> int:
    """One packed row of ``n`` elements: ceil(n/block) blocks of block*bits/8 code bytes plus a 4-byte fp32 scale."""
    return math.ceil(n / block) * (block * bits // 8 + 4)


def expected_wire(op: str, variant: str, bits, size: int) -> tuple[int, int, int]:
    """(intra, inter, header) bytes one rank hands to others: DESIGN.md "Byte accounting" applied to the
    format, one 16-byte header per frame (docs/FORMAT.md "Frames"); none for the ``-raw`` variants."""
    H = 0 if variant.endswith("-raw") else HEADER
    n = size // 4 // W            # shard (all-gather) or slice (reduce-scatter) elements per rank
    if op == "all_gather":        # (W-1) x own buffer; the world group spans nodes, so inter-node
        if variant in ("fp32", "bf16"):
            return 0, (W - 1) * {"fp32": 4, "bf16": 2}[variant] * n, 0
        return 0, (W - 1) * (H + packed_nbytes(n, bits, WEIGHT_BLOCK)), (W - 1) * H
    if op == "replica_gather":    # node-local all-gather of N framed primary shards: (L-1) x N x frame
        return (L - 1) * N * (H + packed_nbytes(n, bits, WEIGHT_BLOCK)), 0, (L - 1) * N * H
    assert op == "reduce_scatter"
    if variant in ("fp32", "bf16"):   # reduce_scatter_tensor: (W-1)/W x input bytes (4 or 2 x W*n), over the world
        return 0, (W - 1) * {"fp32": 4, "bf16": 2}[variant] * n, 0
    # qgZ: every destination slice is packed on its own; hop 1 sends each of the other L-1 local peers one
    # frame holding N slices, hop 2 each of the other N-1 nodes' peers one frame of one (requantized) slice.
    # Chunks cut slices at block multiples, so the packed bytes do not depend on them; each chunk, hop and
    # peer has its own header. k chunks: num_chunks, at most one per block.
    c = int(variant.removesuffix("-raw").partition("x")[2] or 1)
    k = min(c, math.ceil(n / GRAD_BLOCK))
    p = packed_nbytes(n, bits, GRAD_BLOCK)
    return (L - 1) * (N * p + k * H), (N - 1) * (p + k * H), (L - 1 + N - 1) * k * H


def expected_variants():
    quantized = lambda vs: [x for v in vs for x in (v, f"{v}-raw")]  # noqa: E731  (--header-cost)
    return ([("all_gather", v) for v in ["fp32", "bf16"] + quantized(("qwZ8", "qwZ6", "qwZ4", "qwZ2"))]
            + [("replica_gather", v) for v in quantized(("hpZ8",))]
            + [("reduce_scatter", v) for v in ["fp32", "bf16"] + quantized(("qgZ4", f"qgZ4x{CHUNKS}"))])


@slow
def test_json_schema(sweep):
    doc = sweep["doc"]
    assert doc["command"] == "collectives"
    assert doc["world"] == W and doc["ranks_per_node"] == L and doc["num_nodes"] == N
    assert doc["columns"] == list(collectives.COLUMNS)
    for key in ("op", "variant", "size", "count", "type", "time_us", "algbw_GBs", "busbw_GBs", "wire_bytes",
                "ratio_vs_fp32", "max_err", "mean_err"):
        assert key in doc["columns"]
    rows = sweep["rows"]
    assert all(set(r) == set(doc["columns"]) for r in rows)
    assert sorted({r["size"] for r in rows}) == SIZES
    for size in SIZES:
        assert [(r["op"], r["variant"]) for r in rows if r["size"] == size] == expected_variants()
    for r in rows:
        assert r["count"] * 4 == r["size"]
        assert r["type"] == ("bfloat16" if r["variant"] == "bf16" else "float32")
        if r["variant"] in ("fp32", "bf16"):
            assert r["bits"] is None and r["block_size"] is None
        else:
            assert r["block_size"] == (GRAD_BLOCK if r["op"] == "reduce_scatter" else WEIGHT_BLOCK)


@slow
def test_table_and_plot(sweep):
    """A legend of the columns, the table (head, units, one line per row), then the summary."""
    lines = sweep["stdout"].strip().splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["op", "variant"])
    assert "algbw" in lines[head] and "busbw" in lines[head]
    assert lines[0].startswith("columns:") and head > 0
    after = lines[head + 2 + len(sweep["rows"]):]
    assert after[0].startswith("summary at") and "qcoll-bench cluster" in after[-1]
    variants = {line.split()[1] for line in after[2:] if line.split()[:1] in (["all_gather"], ["reduce_scatter"],
                                                                                 ["replica_gather"])}
    assert variants == {r["variant"] for r in sweep["rows"] if r["bits"] is not None and "raw" not in r["variant"]}
    assert "Traceback" not in sweep["stderr"]
    if _has_matplotlib():
        with open(sweep["dir"] / "bw.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@slow
def test_times_and_bandwidths(sweep):
    for r in sweep["rows"]:
        assert r["time_us"] > 0 and r["algbw_GBs"] > 0 and r["busbw_GBs"] > 0, r
        assert r["algbw_GBs"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)
        g = L if r["op"] == "replica_gather" else W
        assert r["busbw_GBs"] == pytest.approx(r["algbw_GBs"] * (g - 1) / g)


@slow
def test_wire_bytes_match_the_format(sweep):
    rows = sweep["rows"]
    for r in rows:
        intra, inter, header = expected_wire(r["op"], r["variant"], r["bits"], r["size"])
        assert (r["intra_bytes"], r["inter_bytes"], r["header_bytes"]) == (intra, inter, header), r
        assert r["wire_bytes"] == intra + inter
        base_op = "all_gather" if r["op"] == "replica_gather" else r["op"]
        base = sum(expected_wire(base_op, "fp32", None, r["size"]))
        assert r["ratio_vs_fp32"] == pytest.approx((intra + inter) / base)


@slow
def test_header_cost_rows_pair_each_quantized_variant(sweep):
    """--header-cost: each quantized row is followed by its -raw twin: the same data without headers."""
    rows = sweep["rows"]
    for r, raw in zip(rows, rows[1:]):
        if raw["variant"] != r["variant"] + "-raw":
            continue
        assert raw["wire_bytes"] == r["wire_bytes"] - r["header_bytes"] and raw["header_bytes"] == 0
        assert (raw["max_err"], raw["mean_err"]) == (r["max_err"], r["mean_err"])


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


# fp32 slack: the scale absmax/qmax, the product x*inv and the dequantized q*scale are each rounded to fp32
# (relative 2**-24), which moves a code by far less than one unit; 1e-6 of max|ref| covers them.
FP32_SLACK = 1e-6


@slow
def test_gather_errors_within_codec_bound(sweep):
    rows = sweep["rows"]
    for r in rows:
        assert 0 <= r["mean_err"] <= r["max_err"], r
        if r["op"] == "reduce_scatter":
            continue
        if r["variant"] == "fp32":
            assert r["max_err"] == 0
        elif r["variant"] == "bf16":
            # round-to-nearest bf16 keeps 8 significant bits (7 stored): unit roundoff 2**-8, so
            # |x' - x| <= 2**-8 |x| <= 2**-8 max|ref|
            assert 0 < r["max_err"] <= 2 ** -8
        else:
            # block absmax quantization: |x - q*scale| <= scale/2 with scale = absmax_block / qmax, and
            # absmax_block <= max|ref|, so the error relative to max|ref| is at most 1/(2*qmax)
            assert 0 < r["max_err"] <= 1 / (2 * _qmax(r["bits"])) + FP32_SLACK, r
    for size in SIZES:
        by = {r["variant"]: r for r in rows if r["size"] == size and r["op"] != "reduce_scatter"}
        # hpZ's backward gather is bit-identical to the qwZ8 forward gather (DESIGN.md)
        assert (by["hpZ8"]["max_err"], by["hpZ8"]["mean_err"]) == (by["qwZ8"]["max_err"], by["qwZ8"]["mean_err"])
        errs = [by[f"qwZ{b}"]["max_err"] for b in (8, 6, 4, 2)]
        assert errs == sorted(errs)


@slow
def test_reduce_scatter_errors_within_two_hop_bound(sweep):
    """qgZ quantizes twice (DESIGN.md): hop 1 each rank's slice, hop 2 each node's partial sum.

    Hop 1: rank r's dequantized value is off by at most absmax_block(x_r)/(2 qmax) <= M_r/(2 qmax), with
    M_r = max|x_r|. A dequantized value never exceeds its block's absmax (|q| <= qmax), so a node's partial
    sum satisfies |p| <= sum of M_r over the node's ranks, and requantizing it (hop 2) adds at most that over
    2 qmax. Summed over all ranks and nodes: |out - ref| <= (sum_r M_r) / qmax. The benchmark divides by
    max|ref| with ref = sum_r x_r, so the bound is sum_r M_r / (qmax max|ref|), plus fp32 summation slack.
    """
    rows = [r for r in sweep["rows"] if r["op"] == "reduce_scatter"]
    for size in SIZES:
        S = size // 4 // W
        inputs = [collectives.reduce_input(r, W, S).double() for r in range(W)]
        ref = torch.stack(inputs).sum(0)
        ratio = sum(float(x.abs().max()) for x in inputs) / float(ref.abs().max())
        by = {r["variant"]: r for r in rows if r["size"] == size}
        assert by["fp32"]["max_err"] == 0
        # bf16: each input rounded (2**-8 |x_r|), then W - 1 additions each rounded (2**-8 of a partial sum,
        # itself at most sum_r M_r, to bf16's precision): at most W 2**-8 sum_r M_r, relative: W 2**-8 ratio
        assert 0 < by["bf16"]["max_err"] <= W * 2 ** -8 * ratio * 1.05, (size, by["bf16"]["max_err"])
        for v in ("qgZ4", f"qgZ4x{CHUNKS}"):
            bound = ratio / _qmax(4) + W * FP32_SLACK * ratio
            assert 0 < by[v]["max_err"] <= bound, (v, size, by[v]["max_err"], bound)
        # chunks cut slices at block multiples: bit-identical results, so identical errors
        assert (by["qgZ4"]["max_err"], by["qgZ4"]["mean_err"]) == \
               (by[f"qgZ4x{CHUNKS}"]["max_err"], by[f"qgZ4x{CHUNKS}"]["mean_err"])


ARG_ERRORS = [
    (["--min", "1X"], "not a size"),
    (["--max", "inf"], "not a size"),
    (["--min", "4K", "--max", "1K"], "larger than --max"),
    (["--nproc", "3", "--ranks-per-node", "2"], "not divisible"),
    (["--bits", "8", "3"], "invalid choice"),
    (["--grad-bits", "5"], "invalid choice"),
    (["--factor", "1"], "at least 2"),
    (["--nproc", "4", "--min", "8"], "one fp32 element per rank"),
    (["--warmup", "-1"], "must be >= 0"),
    (["--json", "/nonexistent/dir/x.json"], "does not exist"),
    (["--json", "/"], "is a folder"),
]


@pytest.mark.parametrize("extra,message", ARG_ERRORS, ids=[" ".join(a) for a, _ in ARG_ERRORS])
def test_argument_errors_exit_2_with_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["collectives", *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qcoll-bench collectives: error:") and message in err[0], err


def test_missing_matplotlib_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(SystemExit) as e:
        cli.main(["collectives", "--plot", "out.png"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib" in err[0], err


@slow
def test_usage_errors_of_the_module_form(tmp_path):
    p = subprocess.run([sys.executable, "-m", "qcoll.bench", "collectives", "--max", "lots"], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path, env=_env())
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "qcoll-bench collectives: error: argument --max/--max-size: not a size: 'lots' (use e.g. 1K, 64M, 1G) "
        "(see qcoll-bench collectives --help)"]
    assert p.stdout == ""


def test_subcommand_registry():
    parser = cli.build_parser()
    assert set(cli.SUBCOMMANDS) <= set(parser.subcommands)
    for name in cli.SUBCOMMANDS:
        sub = parser.subcommands[name]
        args = sub.parse_args([])
        # the subcommands that start ranks share the common options; cluster runs one of them; serve starts
        # a server process, not ranks
        common = ("nproc", "ranks_per_node", "json", "plot", "iters", "warmup")
        expected = {"cluster": ("nodes", "ranks_per_node", "link", "delay", "timeout", "json"),
                    "serve": ("trace", "runs", "slo_ms", "json")}.get(name, common)
        for opt in expected:
            assert hasattr(args, opt), (name, opt)
        assert callable(args.func)


def test_progress_bar_draws_and_erases():
    out = io.StringIO()
    with progress.bar(10, enabled=True, file=out, delay=0, mininterval=0) as p:
        p.set_postfix_str("1K all_gather fp32", refresh=False)
        p.update(0)                       # names the running variant before any progress
        assert "0%" in out.getvalue() and "1K all_gather fp32" in out.getvalue()
        p.update(5)
        text = out.getvalue()
        assert "50%" in text and "qcoll-bench" in text and "\n" not in text
        p.set_postfix_str("1K reduce_scatter qgZ4", refresh=False)
        p.update(0)                       # the next variant is named as it starts, not when it ends
        assert out.getvalue()[len(text):].count("1K reduce_scatter qgZ4") == 1
    last = out.getvalue().rsplit("\r", 2)
    assert out.getvalue().endswith("\r") and last[-2].strip() == "" and "\n" not in out.getvalue()   # erased
    quiet = io.StringIO()
    with progress.bar(10, enabled=False, file=quiet, delay=0) as q:
        q.update(10)
    assert quiet.getvalue() == ""
    late = io.StringIO()
    with progress.bar(10, enabled=True, file=late, delay=60) as q:   # a short sweep prints nothing
        q.set_postfix_str("1K all_gather fp32", refresh=False)
        q.update(0)
        q.update(10)
    assert late.getvalue() == ""


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal_unless_told(monkeypatch):
    monkeypatch.delenv("QCOLL_PROGRESS", raising=False)
    assert progress.wanted(_Tty()) and not progress.wanted(io.StringIO())
    tty = _Tty()
    with progress.bar(10, file=tty, delay=0, mininterval=0) as p:   # enabled=None: decided by wanted()
        p.update(5)
    assert "50%" in tty.getvalue()
    pipe = io.StringIO()
    with progress.bar(10, file=pipe, delay=0, mininterval=0) as p:
        p.update(5)
    assert pipe.getvalue() == ""
    monkeypatch.setenv("QCOLL_PROGRESS", "1")
    assert progress.wanted(io.StringIO())
    monkeypatch.setenv("QCOLL_PROGRESS", "off")
    assert not progress.wanted(_Tty())


def _session_pids(sid: int) -> set[int]:
    pids = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":   # fields: state ppid pgrp session ...
                pids.add(int(d))
    return pids


@slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_every_rank_cleanly(tmp_path):
    """SIGINT to the whole process group (what a terminal's Ctrl-C does) during the sweep: exit 130, no
    traceback from any rank, no process of the run left."""
    cmd = [sys.executable, "-m", "qcoll.bench", "collectives", "--nproc", str(W), "--ranks-per-node", str(L),
           "--min", "64K", "--max", "64M", "--iters", "50"]
    env = _env(QCOLL_PROGRESS="1")
    env.pop("PYTHONWARNINGS")   # as a user runs it: the resource tracker's warnings about leaks are shown
    # as from a terminal: SIGINT handled (a shell's background job, e.g. a CI step run with `&`, inherits it ignored)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, start_new_session=True,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stderr.read1(4096), b"")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not BAR.search(b"".join(chunks)):   # the progress bar: rank 0 is sweeping
            assert proc.poll() is None and time.monotonic() < deadline, b"".join(chunks).decode()
            time.sleep(0.2)
        assert len(_session_pids(proc.pid)) >= W + 1
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=60)
        reader.join(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = b"".join(chunks).decode(errors="replace")
    assert rc == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "leaked" not in err, err   # e.g. a semaphore of a rank's progress bar
    assert "interrupted" in err
    time.sleep(0.5)
    assert _session_pids(proc.pid) == set()


# --- train: the peers as users configure them, and collectives per step (issue 20) -------------

def _count_collectives(rank, world):
    import torch.distributed as dist

    from qcoll.bench.collcount import CollectiveCounter
    from qcoll.comm import Topology
    from qcoll.comm.c10d import all_gather_flat, reduce_scatter_flat

    topo = Topology(L)                      # 2 nodes x 2: intra {0,1} {2,3}, inter {0,2} {1,3}
    x = torch.ones(4)
    dist.all_reduce(x)                      # before: not counted
    with CollectiveCounter() as c:
        dist.all_reduce(x)                                                          # world: spans nodes
        all_gather_flat(torch.empty(8), torch.ones(4), group=topo.intra_group)      # a name bound at import
        dist.all_to_all_single(torch.empty(4), torch.ones(4), group=topo.inter_group)
        reduce_scatter_flat(torch.empty(1), torch.ones(4), async_op=True).wait()    # async: counted once
        dist.barrier()
        mark = c.snapshot()
        dist.broadcast(x, src=0)
        step = c.delta(c.snapshot(), mark)
    dist.all_reduce(x)                      # after: not counted
    restored = not any(hasattr(vars(dist.ProcessGroup).get(m), "__wrapped__") for m in ("allreduce", "barrier"))
    return c.total, c.inter, dict(c.by_op), step, restored


def test_collective_counter_counts_every_call_on_any_group(ranks4):
    """One count per collective, whichever name the caller holds the function by; inter-node = the group spans
    nodes; the ProcessGroup methods are the originals again after the block."""
    for total, inter, by_op, step, restored in ranks4.run(_count_collectives):
        assert (total, inter) == (6, 5)
        assert by_op == {"allreduce": 1, "all_gather_single": 1, "all_to_all_single": 1, "reduce_scatter_single": 1,
                         "barrier": 1, "broadcast": 1}
        assert step == (1, 1, {"broadcast": 1})
        assert restored


TRAIN_LAYERS = 1
TRAIN = ["train", "--nproc", str(W), "--ranks-per-node", str(L), "--modes", "zero3", "zeropp-bf16",
         "fsdp2-qcoll-bf16", "hsdp-qcoll", "--peer", "fsdp2", "fsdp2-bf16", "hsdp-bf16", "--steps", "3", "--warmup", "1",
         "--batch", "4",
         "--layers", str(TRAIN_LAYERS), "--d-model", "64", "--heads", "2"]


@pytest.fixture(scope="module")
def train_peers(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    p = subprocess.run([sys.executable, "-m", "qcoll.bench", *TRAIN, "--json", str(d / "out.json")],
                       capture_output=True, text=True, timeout=600, cwd=d, env=_env(QCOLL_PROGRESS="0"))
    assert p.returncode == 0, p.stderr
    with open(d / "out.json") as f:
        doc = json.load(f)
    return {"runs": {r["mode"]: r for r in doc["runs"]}, "stdout": p.stdout}


@slow
def test_train_fsdp2_bf16_peer_moves_half_the_bytes(train_peers):
    """FSDP2's bytes by DESIGN.md's rule (per unit: two all-gathers and a reduce-scatter of (W-1) shards over the
    world, which spans nodes), 4 bytes per element in fp32 and 2 with the bf16 MixedPrecisionPolicy."""
    from qcoll.testing import TransformerConfig, char_transformer

    runs = train_peers["runs"]
    assert list(runs) == ["zero3", "zeropp-bf16", "fsdp2-qcoll-bf16", "hsdp-qcoll", "fsdp2", "fsdp2-bf16", "hsdp-bf16"]
    model = char_transformer(TransformerConfig(context=64, d_model=64, n_layers=TRAIN_LAYERS, n_heads=2), 0)
    shard = sum(math.ceil(p.numel() / W) for p in model.parameters())
    assert runs["fsdp2"]["inter_bytes_per_step"] == 3 * (W - 1) * 4 * shard
    assert runs["fsdp2-bf16"]["inter_bytes_per_step"] == 3 * (W - 1) * 2 * shard
    # the same model, data and initial values: bf16 training starts from the same loss (to bf16's precision)
    assert runs["fsdp2-bf16"]["first_loss"] == pytest.approx(runs["fsdp2"]["first_loss"], abs=0.02)
    assert runs["zeropp-bf16"]["first_loss"] == pytest.approx(runs["zero3"]["first_loss"], abs=0.02)
    for r in runs.values():
        assert math.isfinite(r["final_loss"])


@slow
def test_train_fsdp2_modes_bytes_and_memory(train_peers):
    """FSDP2 with qcoll's comms against the FSDP2 peers. Bytes: HSDP's by DESIGN.md's rule (the node's shard,
    all-reduced across the N nodes: 2 (N-1)/N of it); qcoll's counted by its collectives. Memory: this rank's
    fp32 parameter shards, gradients and AdamW's two states, 16 bytes per element of its shard (1/W of the model
    on a 1-D mesh, 1/L on HSDP; FSDP2 pads each parameter's dim 0, so about)."""
    from qcoll.testing import TransformerConfig, char_transformer

    runs = train_peers["runs"]
    model = char_transformer(TransformerConfig(context=64, d_model=64, n_layers=TRAIN_LAYERS, n_heads=2), 0)
    N = W // L
    node_shard = sum(math.ceil(p.numel() / L) for p in model.parameters())
    world_shard = sum(math.ceil(p.numel() / W) for p in model.parameters())
    assert runs["hsdp-bf16"]["inter_bytes_per_step"] == 2 * (N - 1) * 2 * node_shard // N
    assert 0 < runs["hsdp-qcoll"]["inter_bytes_per_step"] <= 0.3 * runs["hsdp-bf16"]["inter_bytes_per_step"]
    assert 0 < runs["fsdp2-qcoll-bf16"]["inter_bytes_per_step"] <= 0.15 * runs["fsdp2-bf16"]["inter_bytes_per_step"]
    for mode in ("fsdp2-qcoll-bf16", "hsdp-qcoll", "hsdp-bf16"):
        assert runs[mode]["first_loss"] == pytest.approx(runs["fsdp2"]["first_loss"], abs=0.02)
    for mode, shard in (("fsdp2", world_shard), ("fsdp2-bf16", world_shard), ("fsdp2-qcoll-bf16", world_shard),
                        ("hsdp-bf16", node_shard), ("hsdp-qcoll", node_shard)):
        memory = runs[mode]["memory"]
        assert memory["state"] == pytest.approx(16 * shard, rel=0.1), mode
        assert memory["peak"] > memory["state"]
    assert "state_KiB" in train_peers["stdout"] and "peak_KiB" in train_peers["stdout"]


@slow
def test_train_collectives_per_step_follow_each_schedule(train_peers):
    """Collectives per step against what each schedule issues. FSDP2, fully_shard on each of the B blocks and
    the root: forward all-gathers B + 1, backward B (the root keeps its parameters after the forward, torch's
    documented default), reduce-scatters B + 1. qcoll, G parameter groups (CharTransformer.units(): the
    embedding, the blocks, the final norm, and the root's own positional table): a gather runs node by node, an
    all-gather across nodes (among ranks of equal local index) then one inside the node; ZeRO-3 per group a
    forward and a backward gather and a reduce-scatter over the world; ZeRO++ (hpZ, two-hop qgZ) a forward
    gather, a backward gather in the node and two all-to-alls (in the node, then across nodes); both one
    all-reduce of the optimizer's non-finite check."""
    B = TRAIN_LAYERS
    G = 1 + B + 1 + 1
    runs = train_peers["runs"]
    for peer in ("fsdp2", "fsdp2-bf16"):
        assert runs[peer]["collectives_by_op"] == {"all_gather_single": 2 * B + 1, "reduce_scatter_single": B + 1}
        assert runs[peer]["collectives_per_step"] == runs[peer]["inter_collectives_per_step"] == 3 * B + 2
    z3 = runs["zero3"]
    assert z3["collectives_by_op"] == {"all_gather_single": 4 * G, "reduce_scatter_single": G, "allreduce": 1}
    assert (z3["collectives_per_step"], z3["inter_collectives_per_step"]) == (5 * G + 1, 3 * G + 1)
    zpp = runs["zeropp-bf16"]
    assert zpp["collectives_by_op"] == {"all_gather_single": 3 * G, "all_to_all_single": 2 * G, "allreduce": 1}
    assert (zpp["collectives_per_step"], zpp["inter_collectives_per_step"]) == (5 * G + 1, 2 * G + 1)


@slow
def test_train_says_where_the_time_goes(train_peers):
    """Per run: forward, backward and optimizer seconds that add up to about the step, and the seconds qcoll's
    collectives waited for the transport, per operation (none seen for FSDP2); printed under the table."""
    runs, out = train_peers["runs"], train_peers["stdout"]
    known = {"all_gather (across nodes)", "all_gather (inside the node)", "all_gather", "replica_gather",
             "reduce_scatter", "reduce_scatter (intra-node hop)", "reduce_scatter (inter-node hop)",
             "all_reduce (reduce-scatter)", "all_reduce (all-gather)"}
    for mode, r in runs.items():
        p = r["where_time_goes"]
        phases = p["forward_s"] + p["backward_s"] + p["optimizer_s"]
        assert 0.5 * r["step_time_s"] <= phases <= 1.5 * r["step_time_s"], (mode, phases, r["step_time_s"])
        assert set(p["blocked_s"]) <= known and all(0 <= s <= phases for s in p["blocked_s"].values())
        assert (p["blocked_s"] == {}) == (mode in ("fsdp2", "fsdp2-bf16", "hsdp-bf16")), (mode, p["blocked_s"])
        assert f"  {mode}: forward " in out
    assert {"all_gather (across nodes)", "all_gather (inside the node)", "reduce_scatter"} <= set(
        runs["zero3"]["where_time_goes"]["blocked_s"])


@slow
def test_train_table_shows_collectives_and_the_best_peer(train_peers):
    runs, out = train_peers["runs"], train_peers["stdout"]
    lines = out.strip().splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["mode", "step(ms)"])
    cols = lines[head].split()
    assert "coll/step" in cols and "vs_best" in cols
    rows = {line.split()[0]: line.split() for line in lines[head + 1:head + 1 + len(runs)]}
    assert set(rows) == set(runs)
    best = min((r for m, r in runs.items() if m in ("zero3", "fsdp2", "fsdp2-bf16", "hsdp-bf16")),
               key=lambda r: r["step_time_s"])
    for mode, r in runs.items():
        assert int(rows[mode][cols.index("coll/step")]) == r["collectives_per_step"]
        assert r["best_peer"] == best["mode"]
        assert r["speedup_vs_best_peer"] == pytest.approx(best["step_time_s"] / r["step_time_s"])
        assert float(rows[mode][cols.index("vs_best")]) == pytest.approx(r["speedup_vs_best_peer"], abs=0.006)
    assert f"fastest peer ({best['mode']})" in out


def test_train_units_option_picks_the_model_units_or_every_linear():
    from qcoll.bench import train
    from qcoll.testing import TransformerConfig, char_transformer

    p = train.register(argparse_subparsers())
    model = char_transformer(TransformerConfig(context=16, d_model=32, n_layers=2, n_heads=2), 0)
    assert train.model_units(p.parse_args([]), model) == model.units()
    fine = train.model_units(p.parse_args(["--units", "linears"]), model)
    linears = [m for b in model.blocks for m in b.modules() if isinstance(m, torch.nn.Linear)]
    assert fine == [model.embed, *linears, model.ln_f] and len(linears) == 4 * len(model.blocks)
    with pytest.raises(SystemExit):
        p.parse_args(["--units", "layers"])


def argparse_subparsers():
    import argparse

    return argparse.ArgumentParser().add_subparsers()


def test_break_even_from_measured_times_and_bytes():
    """By hand: quantized 300 us / 800 B against fp32 100 us / 3000 B breaks even where
    2200 B / 200 us = 11e6 B/s = 88 Mbit/s; against bf16 (100 us, 1500 B), 700 B / 200 us = 28 Mbit/s."""
    from qcoll.bench import breakeven

    assert breakeven.break_even_bits_per_s(300e-6, 800, 100e-6, 3000) == pytest.approx(88e6)
    assert breakeven.break_even_bits_per_s(300e-6, 800, 100e-6, 1500) == pytest.approx(28e6)
    assert breakeven.break_even_bits_per_s(50e-6, 800, 100e-6, 3000) == math.inf     # faster and smaller
    assert breakeven.break_even_bits_per_s(300e-6, 3000, 100e-6, 3000) == 0.0       # slower, no bytes saved
    # 6.1 ms / 196,608 B against 3.4 ms / 786,432 B: 4,718,592 bits / 2.7 ms = 1,747,626,667 bit/s = 1.75 Gbit/s
    assert breakeven.break_even_bits_per_s(6.1e-3, 196608, 3.4e-3, 786432) == pytest.approx(1.7476267e9, rel=1e-6)
    assert breakeven.format_rate(1.7476267e9) == "1.75 Gbit/s" and breakeven.format_rate(88e6) == "88.0 Mbit/s"
    assert (breakeven.format_rate(math.inf), breakeven.format_rate(0.0)) == ("always", "never")
    rows = [{"op": "all_gather", "variant": v, "bits": b, "size": 4096, "time_us": t, "wire_bytes": w}
            for v, b, t, w in (("fp32", None, 100, 3000), ("bf16", None, 100, 1500), ("qwZ8", 8, 300, 800),
                               ("qwZ8-raw", 8, 1, 1))]
    rows += [{"op": "reduce_scatter", "variant": v, "bits": b, "size": 4096, "time_us": t, "wire_bytes": w}
             for v, b, t, w in (("fp32", None, 100, 2000), ("qgZ4", 4, 500, 600))]
    rows += [{"op": "all_gather", "variant": "qwZ8", "bits": 8, "size": 1024, "time_us": 1, "wire_bytes": 1}]
    summary = {s["variant"]: s for s in breakeven.summary_rows(rows)}
    assert set(summary) == {"qwZ8", "qgZ4"} and summary["qwZ8"]["size"] == 4096   # the largest size only
    assert summary["qwZ8"]["bytes_vs_fp32"] == pytest.approx(800 / 3000)
    assert summary["qwZ8"]["bytes_vs_bf16"] == pytest.approx(800 / 1500)
    assert summary["qwZ8"]["break_even_vs_bf16"] == pytest.approx(28e6)
    # no bf16 reduce-scatter: half fp32's bytes at fp32's time -> (1000 - 600) B / 400 us = 8 Mbit/s
    assert summary["qgZ4"]["break_even_vs_bf16"] == pytest.approx(8e6)
    assert summary["qgZ4"]["break_even_vs_fp32"] == pytest.approx(28e6)   # 1400 B / 400 us
    assert "(reduce_scatter has no bf16 row" in breakeven.format_summary(rows)
    # a measured bf16 reduce-scatter (60 us, 1000 B) is used instead: 400 B / 440 us = 7.2727 Mbit/s
    rows += [{"op": "reduce_scatter", "variant": "bf16", "bits": None, "size": 4096, "time_us": 60,
              "wire_bytes": 1000}]
    summary = {s["variant"]: s for s in breakeven.summary_rows(rows)}
    assert summary["qgZ4"]["break_even_vs_bf16"] == pytest.approx(7.2727e6, rel=1e-4)
    text = breakeven.format_summary(rows)
    assert "88.0 Mbit/s" in text and "28.0 Mbit/s" in text and "7.3 Mbit/s" in text and "qcoll-bench cluster" in text
    assert "summary at size 4K" in text and "no bf16 row" not in text
    assert text.splitlines()[-1] == breakeven.WHERE_IT_PAYS                    # on loopback: where to see it pay
    cluster = breakeven.format_summary(rows, on_cluster=True).splitlines()   # measured on the cluster's links
    assert breakeven.WHERE_IT_PAYS not in cluster and "rate-limited" in cluster[-1]


def test_legend_names_every_column_of_the_table():
    """One legend line per column heading of the table, in the table's order."""
    from qcoll.bench import breakeven

    heads = collectives.format_table([]).splitlines()[0].split()
    named = [line.split()[0] for line in breakeven.LEGEND.splitlines()[1:] if not line.startswith("   " * 4)]
    assert named == heads
