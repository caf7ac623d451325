"""What ``generate`` and ``rlhf`` share: the Hugging Face decoder they build from a config (random
weights, no downloads), its options, the generation cache's option and their checks."""
from __future__ import annotations

import argparse
import importlib.util

from . import cli

ARCHS = ("gpt2", "llama")


def add_model_options(p: argparse.ArgumentParser, *, d_model: int = 256, vocab: int = 8192) -> None:
    """``--arch``, ``--layers``, ``--d-model``, ``--heads``, ``--vocab``, ``--seed``."""
    g = p.add_argument_group("model (built from a config, random weights)")
    g.add_argument("--arch", default="gpt2", choices=ARCHS, help="Hugging Face decoder (default gpt2)")
    g.add_argument("--layers", type=cli.positive_int, default=4, help="decoder blocks (default 4)")
    g.add_argument("--d-model", type=cli.positive_int, default=d_model, help=f"hidden size (default {d_model})")
    g.add_argument("--heads", type=cli.positive_int, default=4, help="attention heads (default 4)")
    g.add_argument("--vocab", type=cli.positive_int, default=vocab, help=f"vocabulary size (default {vocab})")
    g.add_argument("--seed", type=int, default=0, help="model and prompt seed (default 0)")


def add_cache_option(p: argparse.ArgumentParser) -> None:
    """``--max-cached-mib``: ``zeropp-gen``'s ``generation_mode(max_cached_bytes=)`` (:func:`cache_bytes`)."""
    p.add_argument("--max-cached-mib", type=cli.nonnegative_int, default=None,
                   help="zeropp-gen: generation_mode(max_cached_bytes=) in MiB per rank (default: no limit; 0: "
                        "the hpZ secondary shards only)")


def cache_bytes(args) -> int | None:
    """``--max-cached-mib`` in bytes (None: no limit)."""
    return None if args.max_cached_mib is None else args.max_cached_mib * 2 ** 20


def check_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` for ``--plot`` (no plot), the shared options, a mode listed twice, and
    model options that cannot build a model, or a missing transformers."""
    if args.plot is not None:
        parser.error(f"--plot: {parser.prog} draws no plot (its figures are in the table and --json)")
    cli.check_common(parser, args)
    if len(set(args.modes)) != len(args.modes):
        parser.error(f"--modes lists a mode twice: {' '.join(args.modes)}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    if (args.d_model // args.heads) % 2 and args.arch == "llama":
        parser.error(f"--arch llama needs an even head size; --d-model {args.d_model} / --heads {args.heads} is odd")
    if args.vocab < 3:
        parser.error(f"--vocab must be >= 3 (tokens 0 and 1 are reserved), got {args.vocab}")
    if importlib.util.find_spec("transformers") is None:
        parser.error(f"{parser.prog} needs transformers, a dependency of qcoll: reinstall qcoll (pip install qcoll)")


def build_decoder(args, positions: int):
    """The plain decoder of the model options (fp32, no dropout), seeded by ``--seed``; token 0
    is BOS, token 1 EOS and padding; ``positions`` is the longest sequence it takes."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    common = dict(vocab_size=args.vocab, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if args.arch == "gpt2":
        cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=args.heads,
                                      n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(hidden_size=args.d_model, intermediate_size=4 * args.d_model,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads, max_position_embeddings=positions, **common)
    return transformers.LlamaForCausalLM(cfg)
