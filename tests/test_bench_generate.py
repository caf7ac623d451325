"""``qcoll-bench generate``: argument errors, and one small run on 4 local gloo ranks (2 emulated nodes x 2).

Oracles of the run: the tokens of the unsharded model generated here, in the test's own
process; the bytes per forward derived from the byte-accounting rule (DESIGN.md) and the
wire format (docs/FORMAT.md) for the model's units (the root and one unit per block).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from qcoll.bench import cli, generate

slow = pytest.mark.slow
W, L = 4, 2
N = W // L
HEADER, BLOCK = 16, 256


def _run_main(argv, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


ARG_ERRORS = [
    (["--d-model", "30", "--heads", "4"], "not divisible by --heads"),
    (["--weight-bits", "3"], "invalid choice"),
    (["--modes", "zero3", "zero3"], "lists a mode twice"),
    (["--plot", "x.png"], "draws no plot"),
    (["--tokens", "0"], "must be >= 1"),
]


@pytest.mark.parametrize("extra,message", ARG_ERRORS, ids=[" ".join(a) for a, _ in ARG_ERRORS])
def test_argument_errors_exit_2_with_one_line(extra, message, capsys):
    code, err = _run_main(["generate", *extra], capsys)
    assert code == 2
    assert len(err) == 1 and err[0].startswith("qcoll-bench generate: error:") and message in err[0], err


def _aligned_shard(numels: list[int]) -> int:
    """Shard size of a group with quantized weights: each parameter starts on a block boundary
    (DESIGN.md), and each rank's shard is a whole number of blocks."""
    blocks = lambda n: -(-n // BLOCK)  # noqa: E731
    end = sum(blocks(n) * BLOCK for n in numels[:-1]) + numels[-1]
    return blocks(-(-end // W)) * BLOCK


def _packed(n: int, bits: int) -> int:
    return math.ceil(n / BLOCK) * (BLOCK * bits // 8 + 4)


@slow
def test_small_run_matches_the_unsharded_model_and_the_byte_rule(tmp_path):
    pytest.importorskip("transformers")
    argv = ["--tokens", "3", "--prompt-len", "4", "--layers", "2", "--d-model", "32", "--heads", "2", "--vocab", "128",
            "--modes", "zero3", "zeropp", "zeropp-gen", "--warmup", "0",
            "--max-cached-mib", "0"]  # the hpZ secondaries only (the cache's bytes: tests/test_zero_generation.py)
    env = dict(os.environ, PYTHONWARNINGS="ignore", QCOLL_PROGRESS="0")
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, "-m", "qcoll.bench", "generate", *argv, "--nproc", str(W), "--ranks-per-node",
                        str(L), "--json", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=240,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "out.json").read_text())
    runs = {r["mode"]: r for r in doc["runs"]}
    assert list(runs) == ["zero3", "zeropp", "zeropp-gen"] and (doc["world"], doc["ranks_per_node"]) == (W, L)

    ns = generate.register(argparse.ArgumentParser().add_subparsers()).parse_args(argv)
    plain = generate.build_model(ns)
    prompt = generate._prompt(ns)
    with torch.no_grad():
        want = plain.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, min_new_tokens=3,
                              do_sample=False)[0, prompt.shape[1]:].tolist()
    assert runs["zero3"]["output_tokens"] == want and runs["zero3"]["tokens_match"] is True
    assert runs["zeropp"]["tokens_match"] is True and runs["zeropp-gen"]["tokens_match"] is True
    assert runs["zeropp-gen"]["output_tokens"] == runs["zeropp"]["output_tokens"]

    # groups: one per GPT2Block, the root takes the rest (wte, wpe, ln_f; lm_head is tied to wte)
    in_blocks = {id(q) for b in plain.transformer.h for q in b.parameters()}
    groups = [[q.numel() for q in b.parameters()] for b in plain.transformer.h]
    groups.append([q.numel() for q in plain.parameters() if id(q) not in in_blocks])
    shards = [-(-sum(g) // W) for g in groups]
    # quantized weights: each parameter starts on a block boundary and a shard is whole blocks
    aligned = [_aligned_shard(g) for g in groups]
    # summed over the W ranks, a gather node by node: (N-1) x own buffer per rank across nodes, then
    # (L-1) x the N received buffers inside the node
    frames = sum(HEADER + _packed(s, 8) for s in aligned)
    zero3_inter, zero3_intra = W * (N - 1) * 4 * sum(shards), W * (L - 1) * N * 4 * sum(shards)
    qwz_inter, qwz_intra = W * (N - 1) * frames, W * (L - 1) * N * frames
    # replica_gather: (L-1) x the N kept frames, node-local
    hpz_intra = W * (L - 1) * N * frames
    z3, zpp, gen = runs["zero3"], runs["zeropp"], runs["zeropp-gen"]
    assert z3["inter_bytes_first_forward"] == z3["inter_bytes_per_token_after_first"] == zero3_inter
    assert z3["intra_bytes_first_forward"] == z3["intra_bytes_per_token_after_first"] == zero3_intra
    assert zpp["inter_bytes_first_forward"] == zpp["inter_bytes_per_token_after_first"] == qwz_inter
    assert zpp["intra_bytes_first_forward"] == zpp["intra_bytes_per_token_after_first"] == qwz_intra
    assert gen["inter_bytes_first_forward"] == qwz_inter and gen["inter_bytes_per_token_after_first"] == 0
    assert gen["intra_bytes_first_forward"] == qwz_intra and gen["intra_bytes_per_token_after_first"] == hpz_intra
    assert all(r["forwards"] == 3 and r["link_bytes_total"] is None for r in runs.values())
    assert z3["speedup_vs_zero3"] == 1.0
    assert gen["cached_bytes_per_rank"] == 0 and gen["secondary_bytes_per_rank"] > 0
    assert all(r["vs_unsharded"] > 0 for r in runs.values())
    assert "zeropp-gen" in p.stdout and "tokens/s" in p.stdout
