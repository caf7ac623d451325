"""Models, data and training loops shared by qcoll's tests and benchmarks (installed with qcoll).

- :mod:`qcoll.testing.models`: :class:`CharTransformer` and its :class:`TransformerConfig`,
  :data:`TINY`, :func:`char_transformer`, :func:`tiny_model`.
- :mod:`qcoll.testing.data`: :func:`stdlib_bytes`, :func:`corpus`, :class:`Batches`, :class:`BatchList`.
- :mod:`qcoll.testing.training`: :func:`train_steps` (one loop for a sharded model with
  :class:`qcoll.zero.Optimizer` and a plain model with a torch optimizer), :func:`global_loss`.
- :mod:`qcoll.testing.parity`: :func:`check_parity`, sharded training against its
  single-process oracle.
"""
from .data import BatchList, Batches, corpus, stdlib_bytes
from .models import TINY, CharTransformer, TransformerConfig, byte_llama, causal_lm_loss, char_transformer, tiny_model
from .parity import Parity, check_parity
from .training import global_loss, train_steps

__all__ = ["BatchList", "Batches", "CharTransformer", "byte_llama", "causal_lm_loss", "Parity", "TINY", "TransformerConfig", "char_transformer",
           "check_parity", "corpus", "global_loss", "stdlib_bytes", "tiny_model", "train_steps"]
