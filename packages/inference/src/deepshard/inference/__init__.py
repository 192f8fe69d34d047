"""Inference and generation for DeepShard.

``init_inference(model, config=None, **kwargs)`` wraps a model for evaluation and generation:
cast to the configured dtype, eval mode, tensor parallelism through a parallelizer (the
meta-package's ``deepshard.engine.init_inference`` supplies AutoTP's), weights read tensor by
tensor from a safetensors checkpoint, and ``generate`` by continuous batching over DeepShard's
own static KV cache.
"""

from __future__ import annotations

__all__: list[str] = []
