"""The engine's ``offload_states`` / ``reload_states`` and its ``safe_get_*`` / ``safe_set_*``.

DeepSpeed 0.19.7 has ``engine.offload_states(include, device, pin_memory, non_blocking)`` and
``engine.reload_states(non_blocking)``; here they hand over to the ZeRO optimizer
(`deepshard.zero.ZeroOptimizer.offload_states`), which refuses training calls until the reload,
and the engine refuses its forward as well. DeepSpeed's ``deepspeed.utils.safe_get_full_*``
functions find the optimizer through attributes patched onto the parameter; DeepShard's take
the owner (`deepshard.zero.access`), and these methods pass the engine's ZeRO optimizer. The full
getters and setters (and ``safe_set_local_fp32_param``) are collectives: every data-parallel rank
calls them for the same parameters in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

import deepshard.zero as zero
from deepshard.zero import OffloadReport

if TYPE_CHECKING:
    from deepshard.zero import ZeroOptimizer

__all__ = ["EngineStates"]


class EngineStates:
    """`DeepShardEngine`'s state movement and per-parameter access (a mixin)."""

    _require_optimizer: Callable[..., ZeroOptimizer]
    """The engine's: its ZeRO optimizer (resident unless ``resident=False``), or an error naming
    what needs it."""

    def offload_states(
        self,
        include: Iterable[str] | str | None = None,
        device: object = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> OffloadReport:
        """Move ZeRO's states to host memory, releasing their device storage, until
        `reload_states`; forward, backward and step are refused meanwhile.

        Args:
            include: State types of `deepshard.zero.OFFLOAD_STATE_TYPES` (``"optim_states"``,
                ``"hp_params"``, ``"lp_params"``, ``"lp_grads"``, ``"contiguous_grad_buffer"``;
                DeepSpeed's ``OffloadStateTypeEnum`` members work); ``None`` moves all.
            device: Only ``"cpu"``.
            pin_memory: Page-lock the host buffers where the accelerator can.
            non_blocking: Do not wait for the device-to-host copies.

        Returns:
            What moved; ``device_bytes_freed`` where the accelerator keeps allocator statistics.

        Raises:
            ConfigError: An unknown state type, a device other than cpu, or no optimizer.
            CommError: A state is already offloaded.
        """
        owner = self._require_optimizer("offload_states", resident=False)
        return owner.offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> OffloadReport:
        """Copy the offloaded states back into their original tensors; training continues
        bit for bit.

        Raises:
            CommError: Nothing is offloaded.
        """
        return self._require_optimizer("reload_states", resident=False).reload_states(non_blocking)

    def _owner(self) -> ZeroOptimizer:
        return self._require_optimizer("safe_get_*/safe_set_*", resident=False)

    def safe_get_full_fp32_param(self, param: torch.Tensor) -> torch.Tensor | None:
        """`deepshard.zero.safe_get_full_fp32_param` with this engine's optimizer (collective)."""
        return zero.safe_get_full_fp32_param(param, self._owner())

    def safe_get_full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """`deepshard.zero.safe_get_full_grad` with this engine's optimizer (collective): the
        reduced gradient between the boundary's backward and ``step()``, else ``None``."""
        return zero.safe_get_full_grad(param, self._owner())

    def safe_get_full_optimizer_state(
        self, param: torch.Tensor, optim_state_key: str
    ) -> torch.Tensor | None:
        """`deepshard.zero.safe_get_full_optimizer_state` (collective)."""
        return zero.safe_get_full_optimizer_state(param, self._owner(), optim_state_key)

    def safe_get_local_fp32_param(self, param: torch.Tensor) -> torch.Tensor | None:
        """`deepshard.zero.safe_get_local_fp32_param`: this rank's elements, 1-D."""
        return zero.safe_get_local_fp32_param(param, self._owner())

    def safe_get_local_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """`deepshard.zero.safe_get_local_grad`: this rank's elements, 1-D, or ``None``."""
        return zero.safe_get_local_grad(param, self._owner())

    def safe_get_local_optimizer_state(
        self, param: torch.Tensor, optim_state_key: str
    ) -> torch.Tensor | None:
        """`deepshard.zero.safe_get_local_optimizer_state`: this rank's elements, 1-D."""
        return zero.safe_get_local_optimizer_state(param, self._owner(), optim_state_key)

    def safe_set_full_fp32_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """`deepshard.zero.safe_set_full_fp32_param`: master and model parameter (every rank,
        same value)."""
        zero.safe_set_full_fp32_param(param, self._owner(), value)

    def safe_set_full_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """`deepshard.zero.safe_set_full_grad` (every rank, same value)."""
        zero.safe_set_full_grad(param, self._owner(), value)

    def safe_set_full_optimizer_state(
        self, param: torch.Tensor, value: torch.Tensor, optim_state_key: str
    ) -> None:
        """`deepshard.zero.safe_set_full_optimizer_state` (every rank, same value)."""
        zero.safe_set_full_optimizer_state(param, self._owner(), value, optim_state_key)

    def safe_set_local_fp32_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """`deepshard.zero.safe_set_local_fp32_param` (collective: every rank its own piece)."""
        zero.safe_set_local_fp32_param(param, self._owner(), value)

    def safe_set_local_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """`deepshard.zero.safe_set_local_grad`: this rank's elements."""
        zero.safe_set_local_grad(param, self._owner(), value)

    def safe_set_local_optimizer_state(
        self, param: torch.Tensor, value: torch.Tensor, optim_state_key: str
    ) -> None:
        """`deepshard.zero.safe_set_local_optimizer_state`: this rank's elements."""
        zero.safe_set_local_optimizer_state(param, self._owner(), value, optim_state_key)
