"""Models, data and training loops shared by qcoll's tests and benchmarks (installed with qcoll).

- :mod:`qcoll.testing.models`: :class:`CharTransformer` and its :class:`TransformerConfig`,
  :data:`TINY`, :func:`char_transformer`, :func:`tiny_model`.
- :mod:`qcoll.testing.data`: :func:`stdlib_bytes`, :func:`corpus`, :class:`Batches`, :class:`BatchList`.
- :mod:`qcoll.testing.training`: :func:`global_loss`.
"""
from .data import BatchList, Batches, corpus, stdlib_bytes
from .models import TINY, CharTransformer, TransformerConfig, char_transformer, tiny_model
from .training import global_loss

__all__ = ["BatchList", "Batches", "CharTransformer", "TINY", "TransformerConfig", "char_transformer", "corpus",
           "global_loss", "stdlib_bytes", "tiny_model"]
