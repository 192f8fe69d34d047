"""The byte counts and partitioning facts `ZeroOptimizer` reports (stages 0-2).

A mixin, so `deepshard.zero.optimizer` stays one screenful per concern; `Stage3Optimizer`
overrides what differs at stage 3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from deepshard.zero.reduction import GradientReduction

if TYPE_CHECKING:
    from deepshard.interface import FullGradientPath
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero._flat_params import FlatParams
    from deepshard.zero._full_grad_store import SplitGradients
    from deepshard.zero._offload import HostOffload
    from deepshard.zero._shards import ParamShard
    from deepshard.zero.layout import FlatLayout

__all__ = ["ZeroReads"]


class ZeroReads:
    """What the engine's memory report and the checkpoint code read from a `ZeroOptimizer`."""

    config: ZeroConfig
    inner: torch.optim.Optimizer
    _full: FullGradientPath
    _masters: list[torch.Tensor]
    _flat: list[FlatParams]
    _store: SplitGradients
    _partitions: int
    _partition_rank: int
    _shards: tuple[ParamShard, ...]
    _offload: HostOffload | None

    def optimizer_state_bytes(self) -> int:
        """Bytes of inner-optimizer state tensors and full-gradient buffers on this rank."""
        tensors = [v for s in self.inner.state.values() for v in s.values()]
        inner = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return inner + self._full.nbytes()

    def master_bytes(self) -> int:
        """Bytes of fp32 master weights on this rank beyond the parameters (an unpartitioned
        fp32 group's master is its parameter buffer and counts 0)."""
        separate = [m for m, f in zip(self._masters, self._flat, strict=True) if m is not f.buffer]
        return sum(m.numel() * m.element_size() for m in separate)

    def gradient_bytes(self) -> int:
        """Bytes of gradient storage ZeRO holds on this rank right now."""
        return self._store.nbytes()

    @property
    def reduction(self) -> GradientReduction:
        """How gradients are combined over the data-parallel group."""
        return self._store.settings.reduction

    @property
    def stage(self) -> int:
        """The ZeRO stage."""
        return self.config.stage

    @property
    def partition_count(self) -> int:
        """Ranks the masters are partitioned over (1 at stage 0)."""
        return self._partitions

    @property
    def partition_rank(self) -> int:
        """This rank's partition index (0 at stage 0)."""
        return self._partition_rank

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (``params`` hold this rank's masters)."""
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's state, keyed by master partition (or master view, see
        `full_shape`)."""
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's defaults."""
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    @property
    def layouts(self) -> tuple[FlatLayout, ...]:
        """The flat layout of every unit (one per param group in the params-only form)."""
        return tuple(flat.layout for flat in self._flat)

    @property
    def master_partitions(self) -> tuple[torch.Tensor, ...]:
        """This rank's master partition of every unit (for an unpartitioned unit in the masters'
        dtype, the flat parameter buffer itself; with offload, on the host)."""
        return self._offload.masters() if self._offload is not None else tuple(self._masters)

    def full_shape(self, param: object) -> tuple[int, ...] | None:
        """`deepshard.interface.ParamShapes`: a transformed parameter's shape for its master view
        in the inner optimizer; ``None`` for a flat master (see `deepshard.zero._full_grads`)."""
        return self._full.full_shape(param)

    def shard_maps(self) -> tuple[ParamShard, ...]:
        """Where every element of every trainable parameter's master lives, per rank."""
        return self._shards
