"""DeepSpeed settings DeepShard refuses on purpose, each with the reason and what to use instead.

A key listed here is not a typo: it is a DeepSpeed feature that DeepShard does not carry, or an old
spelling DeepSpeed itself deprecated. Ignoring it would silently change training (a compression
block that no longer quantizes, a checkpoint engine that no longer runs), so the config is refused
with a message that names the replacement. This module is the one table of such keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = [
    "AMP_ENABLED_MESSAGE",
    "DEEPCOMPILE_MESSAGE",
    "HF_AUTO_MESSAGE",
    "HYBRID_ENGINE_MESSAGE",
    "KERNEL_INJECT_MESSAGE",
    "MISPLACED_KEYS",
    "REFUSED_KEYS",
    "REFUSED_OPTIMIZERS",
    "ZERO_BOOLEAN_MESSAGE",
    "refused_key_message",
    "refused_optimizer_message",
]

_NOT_CARRIED = "DeepShard does not carry"

REFUSED_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "nebula": f"{_NOT_CARRIED} the Nebula checkpoint service (DeepSpeed removed it too); "
        "deepshard.checkpoint writes sharded safetensors checkpoints, remove this block",
        "compression_training": f"{_NOT_CARRIED} DeepSpeed's compression library (DeepSpeed "
        "removed it too): the model would silently train unquantized; quantize or prune with "
        "torchao before or after training and remove this block",
        "quantize_training": f"{_NOT_CARRIED} Mixture-of-Quantization (DeepSpeed removed it too); "
        "use torchao quantization-aware training and remove this block",
        "sparse_attention": f"{_NOT_CARRIED} DeepSpeed Sparse Attention (DeepSpeed removed it "
        "too); use torch.nn.functional.scaled_dot_product_attention or FlexAttention in the model",
        "autotuning": f"{_NOT_CARRIED} the autotuner; pick batch sizes and ZeRO knobs yourself "
        "(the flops_profiler and memory_breakdown settings help) and remove this block",
        "pipeline": f"{_NOT_CARRIED} a pipeline-parallel engine (Topology's pp axis is reserved "
        "and always 1); scale with ZeRO-3, tensor_parallel or sequence_parallel_size instead",
        "progressive_layer_drop": f"{_NOT_CARRIED} progressive layer dropping; implement layer "
        "drop inside the model and remove this block",
        "eigenvalue": f"{_NOT_CARRIED} the Hessian eigenvalue estimator; remove this block",
        "weight_quantization": f"{_NOT_CARRIED} DeepSpeed-Inference weight quantization; "
        "quantize with torchao and remove this block",
        "datastates_ckpt": f"{_NOT_CARRIED} the DataStates checkpoint engine; deepshard.checkpoint "
        "saves sharded safetensors, remove this block",
        "zero_optimization.mics_shard_size": f"{_NOT_CARRIED} MiCS sharding (DeepSpeed removed "
        "it too); use zero_optimization.zero_hpz_partition_size for hierarchical ZeRO-3 "
        "partitioning",
        "zero_optimization.mics_hierarchical_params_gather": f"{_NOT_CARRIED} MiCS sharding "
        "(DeepSpeed removed it too); use zero_optimization.zero_hpz_partition_size",
        "zero_optimization.legacy_stage1": f"{_NOT_CARRIED} DeepSpeed's legacy ZeRO-1 "
        "implementation; remove the key, stage 1 always uses the current one",
        "zero_optimization.zenflow": f"{_NOT_CARRIED} ZenFlow; use "
        'zero_optimization.offload_optimizer {"device": "cpu"} instead',
        # not a DeepSpeed key: the ring (context-parallel) mode a DeepShard issue proposed
        "sequence_parallel.sp_mode": f'{_NOT_CARRIED} sp_mode "ring": PyTorch\'s context '
        "parallelism runs only the CUDA attention kernels, so it cannot run (nor be tested) on "
        "gloo/CPU; sequence_parallel_size always means Ulysses, remove the key",
    }
)
"""Refused keys by DeepSpeed key path, with the reason and the replacement."""

_ONE_BIT = (
    f"{_NOT_CARRIED} DeepSpeed's compressed-communication optimizers (DeepSpeed removed them "
    'too); use "type": "Adam" or "AdamW" (same params apart from the compression knobs)'
)

REFUSED_OPTIMIZERS: Mapping[str, str] = MappingProxyType(
    {"onebitadam": _ONE_BIT, "zerooneadam": _ONE_BIT, "onebitlamb": _ONE_BIT}
)
"""Refused ``optimizer.type`` values (compared case-insensitively), with the replacement."""

ZERO_BOOLEAN_MESSAGE = (
    'the boolean form of zero_optimization is a DeepSpeed 0.3 spelling; write {"stage": 1} '
    '(or {"stage": 0} for false) instead'
)
"""Why ``"zero_optimization": true`` is refused."""

AMP_ENABLED_MESSAGE = (
    f'{_NOT_CARRIED} NVIDIA apex AMP; use bf16 {{"enabled": true}} or fp16 '
    '{"enabled": true} (optionally torch_autocast) instead'
)
"""Why ``amp.enabled: true`` is refused."""

KERNEL_INJECT_MESSAGE = (
    f"{_NOT_CARRIED} DeepSpeed-Inference kernel injection; AutoTP shards the model's own "
    "torch modules, set it to false"
)
"""Why ``tensor_parallel.replace_with_kernel_inject: true`` is refused."""

HYBRID_ENGINE_MESSAGE = (
    f"{_NOT_CARRIED} the RLHF hybrid engine; generate rollouts from the training engine with "
    "deepshard.inference's build_rollout(config, engine, tokenizer) and set enabled to false"
)
"""Why ``hybrid_engine.enabled: true`` is refused (the section is accepted switched off)."""

DEEPCOMPILE_MESSAGE = (
    f"{_NOT_CARRIED} DeepCompile; call torch.compile on the model before "
    "deepshard.engine.initialize and set deepcompile to false"
)
"""Why ``compile.deepcompile: true`` is refused (the section is accepted switched off)."""

HF_AUTO_MESSAGE = (
    "'auto' is a Hugging Face Trainer placeholder: the HF Trainer replaces it with a number "
    "before DeepSpeed sees the config, and DeepSpeed itself refuses it too. Write the value, or "
    "let the HF Trainer integration fill the config in"
)
"""Why a literal ``"auto"`` value is refused."""


_OPTIMIZER_PARAMS = frozenset(
    {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "amsgrad",
     "torch_adam", "fused", "momentum", "nesterov"}
)  # fmt: skip
"""Optimizer arguments that configs sometimes write beside ``optimizer.type``."""

MISPLACED_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "curriculum_learning.schedule_config.total_step": "did you mean "
        "'total_curriculum_step'? (the steps the schedule takes to reach max_difficulty)",
    }
)
"""Unknown keys whose right spelling or place is known, by key path, with the hint."""


def refused_key_message(path: str) -> str | None:
    """Returns why DeepShard refuses the DeepSpeed key at ``path``, or ``None`` if it does not.

    Covers the keys refused on purpose (`REFUSED_KEYS`) and unknown keys whose right place is
    known: `MISPLACED_KEYS`, and optimizer arguments written beside ``optimizer.type`` (DeepSpeed
    reads only ``type``, ``params`` and ``legacy_fusion`` there and drops the rest without a
    word, so the argument would never reach the optimizer).

    Args:
        path: A DeepSpeed key path such as ``"zero_optimization.cpu_offload"``.

    Returns:
        The reason and the replacement, or ``None``.
    """
    section, _, key = path.partition(".")
    if section == "optimizer" and key in _OPTIMIZER_PARAMS:
        return (
            f"unknown key here; optimizer arguments go inside optimizer.params "
            f'("params": {{"{key}": ...}}); DeepSpeed drops it here without a word'
        )
    return REFUSED_KEYS.get(path) or MISPLACED_KEYS.get(path)


def refused_optimizer_message(optimizer_type: str) -> str | None:
    """Returns why DeepShard refuses an ``optimizer.type``, or ``None`` if it does not.

    Args:
        optimizer_type: The type as written in the config (any case).

    Returns:
        The reason and the replacement, or ``None``.
    """
    return REFUSED_OPTIMIZERS.get(optimizer_type.lower())
