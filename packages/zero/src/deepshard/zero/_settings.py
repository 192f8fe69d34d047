"""What of a config ZeRO stages 0-2 can run, refused with the key path to change otherwise."""

from __future__ import annotations

from deepshard.interface.config import ZeroConfig
from deepshard.interface.errors import ConfigError

__all__ = ["check_zero_settings"]


def check_zero_settings(config: ZeroConfig, *, gradient_clipping: float) -> None:
    """Refuse settings this package does not run, naming the key and the alternative.

    Args:
        config: The ``zero_optimization`` section.
        gradient_clipping: The top-level ``gradient_clipping``.

    Raises:
        ConfigError: Listing every problem found.
    """
    problems: list[tuple[str, str]] = []
    if config.stage == 3:
        problems.append(
            ("zero_optimization.stage", "3 is not available yet in deepshard.zero; use 0, 1 or 2")
        )
    if gradient_clipping < 0:
        problems.append(
            ("gradient_clipping", f"must be >= 0 (0 disables), got {gradient_clipping}")
        )
    if not config.compute_grad_norm and gradient_clipping > 0:
        problems.append(
            (
                "zero_optimization.compute_grad_norm",
                f"false needs gradient_clipping 0 (clipping needs the norm); gradient_clipping "
                f"is {gradient_clipping}",
            )
        )
    offload = config.offload_optimizer
    if offload is not None and offload.device != "none":
        problems.append(
            (
                "zero_optimization.offload_optimizer",
                f'device "{offload.device}" is not available yet in deepshard.zero; remove the '
                'section or set its device to "none"',
            )
        )
    if not config.allgather_partitions:
        problems.append(
            (
                "zero_optimization.allgather_partitions",
                "false (broadcast instead of all-gather) is not supported; remove the key",
            )
        )
    if problems:
        raise ConfigError.from_problems(problems)
