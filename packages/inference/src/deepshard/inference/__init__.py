"""Inference and generation for DeepShard.

``init_inference(model, config=None, **kwargs)`` wraps a model for evaluation and generation:
cast to the configured dtype, eval mode, tensor parallelism through a parallelizer (the
meta-package's ``deepshard.engine.init_inference`` supplies AutoTP's), weights read tensor by
tensor from a safetensors checkpoint, and ``generate`` by continuous batching over DeepShard's
own static KV cache. ``build_rollout`` generates rollouts inside a trainer from the training
engine's own weights (``engine.generation_context``).
"""

from __future__ import annotations

from deepshard.inference._cache import StaticKVCache, head_dim_of
from deepshard.inference._checkpoint import load_checkpoint
from deepshard.inference._engine import InferenceEngine, init_inference
from deepshard.inference._loop import CacheUnsupportedError, generate_requests
from deepshard.inference._profile import GenerationProfile
from deepshard.inference._rollout import (
    RolloutBatch,
    RolloutConfig,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
)
from deepshard.inference._rollout_colocated import ColocatedRollout, GenerationSource, build_rollout
from deepshard.inference._rope import check_rope_supported, rope_theta
from deepshard.inference._sampling import GenerationRequest, GenerationResult
from deepshard.inference._scheduler import ContinuousBatchScheduler, ScheduleStep
from deepshard.interface.config import InferenceConfig, InferenceTensorParallelConfig

__all__ = [
    "CacheUnsupportedError",
    "ColocatedRollout",
    "ContinuousBatchScheduler",
    "GenerationProfile",
    "GenerationRequest",
    "GenerationResult",
    "GenerationSource",
    "InferenceConfig",
    "InferenceEngine",
    "InferenceTensorParallelConfig",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingConfig",
    "ScheduleStep",
    "StaticKVCache",
    "build_rollout",
    "check_rope_supported",
    "generate_requests",
    "head_dim_of",
    "init_inference",
    "load_checkpoint",
    "rope_theta",
]
