"""Rules that span sections of the config, each reported with the key path to change."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepshard.interface.config.deepshard_config import DeepShardConfig

__all__ = ["cross_section_problems"]

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _precision_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    stage = config.zero_optimization.stage
    if config.fp16.enabled and config.bf16.enabled:
        problems.append(("bf16.enabled", "fp16 and bf16 cannot both be enabled; pick one"))
    if config.fp16.fp16_master_weights_and_grads and stage == 0:
        problems.append(
            ("fp16.fp16_master_weights_and_grads", "needs zero_optimization.stage >= 1")
        )
    if config.bf16.bf16_master_weights_and_grads and stage == 0:
        problems.append(
            ("bf16.bf16_master_weights_and_grads", "needs zero_optimization.stage >= 1")
        )
    if config.bf16.bf16_optimizer_states:
        if not config.bf16.bf16_master_weights_and_grads:
            problems.append(
                ("bf16.bf16_optimizer_states", "needs bf16.bf16_master_weights_and_grads")
            )
        if stage == 0:
            problems.append(("bf16.bf16_optimizer_states", "needs zero_optimization.stage >= 1"))
    if config.bf16.bf16_master_weights_and_grads:
        problems += _bf16_master_problems(config)
    if config.fp16.fp16_master_weights_and_grads:
        problems += _fp16_master_problems(config)
    return problems


def _offload_device(config: DeepShardConfig) -> str:
    offload = config.zero_optimization.offload_optimizer
    return "none" if offload is None else offload.device


def _fp16_master_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    """fp16 masters run as in DeepSpeed only: on the host with fp32 moments (CPU Adam)."""
    key = "fp16.fp16_master_weights_and_grads"
    problems: list[tuple[str, str]] = []
    if not config.fp16.enabled:
        problems.append((key, "needs fp16.enabled: the masters are kept in the model's fp16"))
    if _offload_device(config) == "none":
        problems.append(
            (key, 'needs zero_optimization.offload_optimizer {"device": "cpu"} (or "nvme"): fp16 '
             "masters are stepped with fp32 moments by the CPU Adam kernel (as DeepSpeed)")
        )  # fmt: skip
    return problems


def _bf16_master_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    """What DeepShard's bf16 masters need beyond DeepSpeed's rules (`deepshard.zero`'s
    ``_master_dtype`` says why)."""
    key = "bf16.bf16_master_weights_and_grads"
    problems: list[tuple[str, str]] = []
    if not config.bf16.enabled:
        problems.append((key, "needs bf16.enabled: the masters are kept in the model's bf16"))
    device = _offload_device(config)
    states = config.bf16.bf16_optimizer_states
    if device == "none" and not states:
        problems.append(
            (key, "keeps fp32 optimizer states beside bf16 masters only on the host (the CPU "
             "Adam kernel, as DeepSpeed): add zero_optimization.offload_optimizer "
             '{"device": "cpu"} or set bf16.bf16_optimizer_states: true')
        )  # fmt: skip
    return problems


def _parallel_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    if config.gradient_allreduce_op == "sum" and config.zero_optimization.stage == 3:
        problems.append(("gradient_allreduce_op", '"sum" is not supported with ZeRO stage 3'))
    moe_ep, autoep = config.moe.ep_size, config.expert_parallel.ep_size
    if moe_ep > 1 and autoep > 1 and moe_ep != autoep:
        problems.append(
            ("moe.ep_size", f"{moe_ep} disagrees with expert_parallel.autoep_size {autoep}")
        )
    return problems


def _elastic_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    elastic = config.elasticity
    if not elastic.enabled or elastic.ignore_non_elastic_batch_info:
        return []
    return [
        (
            key,
            "elasticity decides the batch sizes; remove this key or set "
            "elasticity.ignore_non_elastic_batch_info to true",
        )
        for key in _BATCH_KEYS
        if getattr(config, key) is not None
    ]


def cross_section_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    """Returns every cross-section inconsistency of a parsed config.

    Args:
        config: The config, each section already valid on its own.

    Returns:
        ``(key path, message)`` pairs; empty when the sections agree.
    """
    return _precision_problems(config) + _parallel_problems(config) + _elastic_problems(config)
