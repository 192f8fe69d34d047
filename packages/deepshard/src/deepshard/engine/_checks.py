"""What of a valid config this engine runs; the rest is refused (or, when harmless, reported).

The config schema accepts every DeepSpeed key. Which features are not there yet is data: the
feature table of `deepshard.interface.status`, which the docs are generated from too. A feature
that changes what training computes and is not wired yet (a ``planned`` row) is refused with the
key to change, before anything is built: running it silently as plain data parallelism would
train something else than asked. A feature that is accepted but has no effect yet (an
``ignored`` row: monitors, the FLOPs profiler, activation partitioning, stage-3 knobs...) is
reported once on rank 0, with every key of the user's config it ignores. Contradictions between
settings are checked here in code.
"""

from __future__ import annotations

from deepshard.engine._tensor_parallel import tp_config_problems
from deepshard.engine.curriculum import curriculum_problems
from deepshard.engine.random_ltd import random_ltd_problems
from deepshard.interface.config import DeepShardConfig
from deepshard.interface.errors import ConfigError
from deepshard.interface.status import asked_features, planned_problems
from deepshard.zero import zero_problems

__all__ = ["check_engine_config", "ignored_settings"]


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
    return problems


def check_engine_config(config: DeepShardConfig) -> None:
    """Refuses every setting this engine cannot train as asked, naming each key.

    Refused: every ``planned`` row of the feature table the config asks for (stage 3, offload,
    AutoTP, ...), contradictions between settings, and what `deepshard.zero.zero_problems`
    refuses (``compute_grad_norm: false`` with clipping, ...). Only the optimizer itself is
    checked later, by `deepshard.zero` when it is wrapped.

    Args:
        config: The validated config.

    Raises:
        ConfigError: Listing every problem found.
    """
    zero = zero_problems(config.zero_optimization, gradient_clipping=config.gradient_clipping)
    # ZeRO repeats the table's ZeRO rows (it refuses them when used on its own, too), in the
    # same words: list each problem once.
    problems = planned_problems(config) + _precision_problems(config) + zero
    problems += tp_config_problems(config)
    problems += curriculum_problems(config) + random_ltd_problems(config)
    problems = list(dict.fromkeys(problems))
    if problems:
        raise ConfigError.from_problems(problems)


def ignored_settings(config: DeepShardConfig) -> list[str]:
    """The accepted-but-inactive features the config asks for, one line each (to warn about).

    Args:
        config: The validated config.

    Returns:
        One line per ``ignored`` row of the feature table that the config asks for, e.g.
        ``"tensorboard: the TensorBoard monitor, planned in deepshard"``.
    """
    lines = []
    for row in asked_features(config, "ignored"):
        owner = f", planned in {row.package}" if row.package else ""
        lines.append(f"{row.key}: {row.feature}{owner}")
    return lines
