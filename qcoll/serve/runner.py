"""The model the server runs: an exported weight-quantized decoder, as next-token logits for a batch.

Two back ends, one interface (:class:`Runner`):

- :class:`TorchRunner`: the quantized-weights safetensors file (:func:`qcoll.zero.export_quantized`)
  loaded by :func:`qcoll.weights.load_quantized` into the Hugging Face architecture its
  ``config.json`` describes (built with ``from_config``: no weights or code are downloaded, and
  ``trust_remote_code`` stays off, so no code from the config runs). The files are checked before
  the model is allocated (:mod:`.model_files`): a config asking for more parameters than the
  weights file holds, nested too deep, or a path that is not a regular file is a ValueError
  naming the file.
- :class:`OnnxRunner`: the ONNX export (:func:`qcoll.weights.onnx.export_onnx`) through onnxruntime;
  its ``input_ids`` must have dynamic batch and sequence axes; a file onnxruntime cannot load is a
  ValueError naming it.

A batch is a list of prompts (lists of token ids). Prompts of one length run together as one
forward (no padding, so a prompt's logits do not depend on a pad or mask); prompts of other
lengths run as their own forwards, in the same call.
"""
from __future__ import annotations

import os
import threading
from collections import defaultdict

import numpy as np
import torch

from . import model_files


class Runner:
    """``vocab_size``, ``max_positions``, and :meth:`logits` / :meth:`generate` over a batch."""

    vocab_size: int
    max_positions: int

    def set_threads(self, intra_op: int) -> None:
        """Intra-op threads for the forwards that start from now on."""
        raise NotImplementedError

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        """int64 ``[B, T]`` -> float32 ``[B, V]``: the last position's logits."""
        raise NotImplementedError

    def logits(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """float32 ``[vocab_size]`` next-token logits for each prompt (token ids), in order."""
        out: list = [None] * len(prompts)
        groups = defaultdict(list)
        for i, p in enumerate(prompts):
            groups[len(p)].append(i)
        for idx in groups.values():
            rows = self._forward(np.asarray([prompts[i] for i in idx], dtype=np.int64))
            for i, row in zip(idx, rows):
                out[i] = row
        return out

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
        """Greedy continuation: ``max_new_tokens[i]`` tokens after ``prompts[i]`` (argmax of each
        step's logits, the lowest id on a tie, as ``torch.argmax``); each step is one batched forward."""
        seqs = [list(p) for p in prompts]
        new: list[list[int]] = [[] for _ in prompts]
        live = [i for i, n in enumerate(max_new_tokens) if n > 0]
        while live:
            for i, row in zip(live, self.logits([seqs[i] for i in live])):
                token = int(np.argmax(row))
                seqs[i].append(token)
                new[i].append(token)
            live = [i for i in live if len(new[i]) < max_new_tokens[i]]
        return new


class TorchRunner(Runner):
    """A plain torch module (``model(input_ids).logits``), in eval mode, without autograd."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, max_positions: int):
        self.model = model.eval()
        self.vocab_size, self.max_positions = int(vocab_size), int(max_positions)

    @classmethod
    def from_files(cls, model_file, config) -> "TorchRunner":
        """The exported safetensors ``model_file`` in the architecture of ``config`` (a Hugging Face
        ``config.json``, or the folder holding one). Both files are checked first
        (:mod:`.model_files`): regular files, the config bounded in size and nesting, and the model it
        describes, built on the meta device, no larger than the weights file can hold; ValueError
        naming the file otherwise, before the model is allocated."""
        import transformers

        from ..weights import load_quantized

        path = os.fspath(model_file)
        if config is None:
            raise ValueError(f"{path!r} is a quantized-weights file: it holds no architecture, so "
                             "pass config= (the model's Hugging Face config.json, or the folder holding it)")
        size = model_files.regular_file(path, "model_file")
        if not os.path.exists(config):
            raise ValueError(f"config {os.fspath(config)!r}: no such file or folder")
        config_path = model_files.config_file(config)
        transformers.logging.set_verbosity_error()
        try:
            cfg = transformers.AutoConfig.from_pretrained(config_path, trust_remote_code=False)
        except (ValueError, TypeError, KeyError, AttributeError, OSError, RecursionError) as e:
            raise ValueError(f"config {config_path!r}: transformers cannot read it ({type(e).__name__}: "
                             f"{_first_line(e)})") from e

        def build():
            return transformers.AutoModelForCausalLM.from_config(cfg, trust_remote_code=False)

        model_files.check_model_size(cfg, config_path, path, size, build)
        model = build()
        try:
            load_quantized(path, model)
        except RuntimeError as e:   # load_state_dict's missing or unexpected keys (several lines)
            raise ValueError(f"model_file {path!r} does not hold the model of config {config_path!r}: "
                             f"{_first_line(e)}") from e
        positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
        return cls(model, cfg.vocab_size, positions)

    def set_threads(self, intra_op: int) -> None:
        torch.set_num_threads(int(intra_op))   # process-wide in torch: applies to every worker's next forward

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out = self.model(torch.from_numpy(ids))
        logits = out.logits if hasattr(out, "logits") else out
        return logits[:, -1, :].float().numpy()


class OnnxRunner(Runner):
    """An onnxruntime session per intra-op thread count (sessions fix it when created)."""

    def __init__(self, path, vocab_size: int | None = None, max_positions: int | None = None):
        import onnxruntime as ort

        self._ort, self.path = ort, os.fspath(path)
        model_files.regular_file(self.path, "model_file")
        self._sessions: dict[int, object] = {}
        self._lock = threading.Lock()
        self._threads = 1
        try:
            session = self._session(1)
        except Exception as e:   # onnxruntime's errors (InvalidProtobuf, Fail, ...) share no base class
            raise ValueError(f"{self.path!r} is not an ONNX model onnxruntime can load ({type(e).__name__}: "
                             f"{_first_line(e)})") from e
        inputs = session.get_inputs()
        if [i.name for i in inputs] != ["input_ids"]:
            raise ValueError(f"{self.path!r}: the graph's inputs are {[i.name for i in inputs]}, expected "
                             "['input_ids'] (export with input_names=['input_ids'])")
        shape = inputs[0].shape
        if len(shape) != 2 or any(isinstance(d, int) for d in shape):
            raise ValueError(f"{self.path!r}: input_ids has shape {shape}; serving needs dynamic batch and sequence "
                             "axes (export with dynamic_shapes)")
        out = session.get_outputs()[0].shape
        if vocab_size is None:
            if len(out) != 3 or not isinstance(out[-1], int):
                raise ValueError(f"{self.path!r}: the first output has shape {out}, not [batch, seq, vocab]")
            vocab_size = out[-1]
        if max_positions is None:   # export_onnx records the decoder's; else the longest a server takes here
            recorded = session.get_modelmeta().custom_metadata_map.get("qcoll.max_positions", "")
            max_positions = int(recorded) if recorded.isdigit() and int(recorded) > 0 else 2048
        self.vocab_size, self.max_positions = int(vocab_size), int(max_positions)

    def _session(self, threads: int):
        with self._lock:
            if threads not in self._sessions:
                opts = self._ort.SessionOptions()
                opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
                opts.log_severity_level = 3
                self._sessions[threads] = self._ort.InferenceSession(self.path, opts,
                                                                     providers=["CPUExecutionProvider"])
            return self._sessions[threads]

    def set_threads(self, intra_op: int) -> None:
        self._threads = int(intra_op)
        self._session(self._threads)

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        (logits,) = self._session(self._threads).run(None, {"input_ids": ids})[:1]
        return np.ascontiguousarray(logits[:, -1, :], dtype=np.float32)


def load_runner(model_file, config=None) -> Runner:
    """The runner for an exported model: ``.safetensors`` (with ``config``) or ``.onnx``."""
    if not isinstance(model_file, (str, os.PathLike)):
        raise TypeError(f"model_file must be a str or os.PathLike, got {type(model_file).__name__}")
    path = os.fspath(model_file)
    model_files.regular_file(path, "model_file")
    if path.endswith(".onnx"):
        if config is not None:
            raise ValueError("config= is for a quantized-weights safetensors file; an ONNX file holds its graph")
        return OnnxRunner(path)
    if path.endswith(".safetensors"):
        return TorchRunner.from_files(path, config)
    raise ValueError(f"model_file {path!r}: expected a .safetensors file (qcoll.zero.export_quantized) or an "
                     ".onnx file (qcoll.weights.onnx.export_onnx)")


def _first_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message as one line (its first, cut to ``limit`` characters)."""
    lines = str(e).strip().splitlines()
    line = lines[0].strip() if lines else ""
    return line if len(line) <= limit else line[:limit] + "..."
