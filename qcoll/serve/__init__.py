"""Serving the exported weight-quantized model over HTTP, its batching tuned online under a latency SLO.

    runner = qcoll.serve.load_runner("model.safetensors", config="config.json")   # or "model.onnx"
    server = qcoll.serve.Server(runner, scheduler=qcoll.serve.SloScheduler(slo_s=0.1))
    uvicorn.run(qcoll.serve.build_app(server))          # or: qcoll-serve model.safetensors --config config.json

Layers: :mod:`.runner` (the model: batched logits and greedy generation), :mod:`.batcher` (the
queue and its run-time knobs), :mod:`.scheduler` (RRL over the knobs, engine-independent),
:mod:`.app` (HTTP: validation, 4xx/503, metrics), :mod:`.body` (bodies under a size limit, JSON
under a nesting limit), :mod:`.admin` (``PUT /admin/config``: off, token, bounds),
:mod:`.model_files` (a model's files checked before loading), :mod:`.cli` (``qcoll-serve``).
"""
from .app import Server, build_app
from .batcher import Batcher, BatchConfig, Overloaded
from .runner import OnnxRunner, Runner, TorchRunner, load_runner
from .scheduler import SloScheduler, serve_space

__all__ = ["Server", "build_app", "Batcher", "BatchConfig", "Overloaded", "Runner", "TorchRunner", "OnnxRunner",
           "load_runner", "SloScheduler", "serve_space"]
