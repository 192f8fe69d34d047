"""What of a valid config this engine runs; the rest is refused (or, for reporting, noted).

The config schema accepts every DeepSpeed key. Features that change what training computes but
are not wired into this engine yet are refused with the key to change, before anything is built:
running them silently as plain data parallelism would train something else than asked. Features
that only observe (monitors) are reported once as not active, as is a
``bf16.check_grad_overflow: false`` (ZeRO's overflow check costs nothing, so it stays on).
"""

from __future__ import annotations

from deepshard.interface.config import DeepShardConfig
from deepshard.interface.errors import ConfigError

__all__ = ["check_engine_config", "ignored_settings"]

_NOT_WIRED = "is not wired into the engine yet"


def _parallel_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    problems = []
    if config.tensor_parallel.size > 1:
        problems.append(
            ("tensor_parallel.autotp_size", f"{config.tensor_parallel.size}: AutoTP {_NOT_WIRED}")
        )
    if config.sequence_parallel_size > 1:
        problems.append(
            (
                "sequence_parallel_size",
                f"{config.sequence_parallel_size}: Ulysses sequence parallelism {_NOT_WIRED}",
            )
        )
    if not config.managed_gradient_accumulation:
        problems.append(
            (
                "managed_gradient_accumulation",
                "false (the caller marks boundaries) is not supported yet: ZeRO reduces during "
                "the boundary's backward pass, so the engine must know the boundary in advance; "
                "remove the key",
            )
        )
    return problems


def _precision_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    problems = []
    autocast = config.torch_autocast
    if autocast.enabled and (config.fp16.enabled or config.bf16.enabled):
        problems.append(
            (
                "torch_autocast.enabled",
                "cannot be combined with fp16.enabled or bf16.enabled: autocast keeps the "
                "parameters in fp32; pick one",
            )
        )
    if autocast.enabled and autocast.lower_precision_safe_modules is not None:
        problems.append(
            (
                "torch_autocast.lower_precision_safe_modules",
                "per-module communication dtypes are not supported; remove the key and set "
                "communication_data_type to reduce every gradient in a lower dtype",
            )
        )
    low = "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else None
    param_dtype = config.data_types.param_dtype
    if low is not None and param_dtype is not None and param_dtype != low:
        problems.append(
            ("data_types.param_dtype", f"{param_dtype} contradicts {low}.enabled; remove one")
        )
    for key, value in (
        ("fp16.fp16_master_weights_and_grads", config.fp16.fp16_master_weights_and_grads),
        ("bf16.bf16_master_weights_and_grads", config.bf16.bf16_master_weights_and_grads),
        ("bf16.bf16_optimizer_states", config.bf16.bf16_optimizer_states),
    ):
        if value:
            problems.append((key, "16-bit master weights are not supported yet; remove the key"))
    return problems


def _feature_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    problems = []
    for key, enabled in (
        ("elasticity.enabled", config.elasticity.enabled),
        ("curriculum_learning.enabled", config.curriculum_learning.enabled),
        ("data_efficiency.enabled", config.data_efficiency.enabled),
        ("sparse_gradients", config.sparse_gradients),
    ):
        if enabled:
            problems.append((key, f"true: this feature {_NOT_WIRED}; remove the key"))
    return problems


def check_engine_config(config: DeepShardConfig) -> None:
    """Refuses every setting this engine cannot train as asked, naming each key.

    ZeRO's own settings (stage 3, offload, ``compute_grad_norm`` with clipping...) are checked
    by `deepshard.zero` when the optimizer is wrapped.

    Args:
        config: The validated config.

    Raises:
        ConfigError: Listing every problem found.
    """
    problems = _parallel_problems(config) + _precision_problems(config)
    problems += _feature_problems(config)
    if problems:
        raise ConfigError.from_problems(problems)


def ignored_settings(config: DeepShardConfig) -> list[str]:
    """Settings this engine accepts but does not act on, each with the reason (to warn about).

    Args:
        config: The validated config.

    Returns:
        One line per setting, e.g. ``"tensorboard.enabled: monitors are not wired ..."``.
    """
    monitors = {
        "tensorboard.enabled": config.tensorboard.enabled,
        "wandb.enabled": config.wandb.enabled,
        "csv_monitor.enabled": config.csv_monitor.enabled,
        "comet.enabled": config.comet.enabled,
    }
    lines = [f"{key}: {_NOT_WIRED}; ignored" for key, enabled in monitors.items() if enabled]
    if config.bf16.enabled and not config.bf16.check_grad_overflow:
        lines.append(
            "bf16.check_grad_overflow: false is ignored; ZeRO always skips a step whose "
            "gradients are not finite (the flag travels in the gradient-norm all-reduce)"
        )
    return lines
