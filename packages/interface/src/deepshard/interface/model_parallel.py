"""How an inference engine gets a tensor-parallel model without importing the package that splits it.

``deepshard.inference`` (row 4) may not import ``deepshard.autotp`` (the same row). It declares
what it needs as `ModelParallelizer`; the meta-package's ``deepshard.engine.init_inference``
passes an implementation backed by AutoTP. The interface never imports torch, so models, groups
and paths are typed loosely here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["ModelParallelizer", "ParallelizedModel"]


@dataclass(frozen=True)
class ParallelizedModel:
    """A model split over a tensor-parallel group, and what generation needs to know about it.

    Attributes:
        module: The split model (forward returns whole logits on every rank).
        tp_size: Ranks in the group.
        tp_rank: This rank's index in the group.
        group: The ``torch.distributed`` process group of the tensor-parallel ranks (None at
            ``tp_size`` 1); the engine broadcasts sampling seeds over it.
        kv_heads: This rank's local KV-head count (its KV cache is sized from it); None when
            the model keeps its config's count.
    """

    module: Any
    tp_size: int
    tp_rank: int
    group: Any = None
    kv_heads: int | None = None


@runtime_checkable
class ModelParallelizer(Protocol):
    """Splits a model over ``tp_size`` ranks and loads whole checkpoints onto the split layout."""

    def parallelize(self, model: Any, tp_size: int, tp_grain_size: int) -> ParallelizedModel:
        """Splits ``model`` in place over a group of ``tp_size`` adjacent ranks.

        Args:
            model: A plain model on its final device and dtype.
            tp_size: The tensor-parallel degree (> 1).
            tp_grain_size: Granularity (elements) MLP / lm_head shards are rounded to.

        Returns:
            The split model and its group.
        """
        ...

    def load_checkpoint(self, parallel: ParallelizedModel, path: str) -> list[str]:
        """Loads a whole safetensors checkpoint tensor by tensor, each rank taking its slices.

        Args:
            parallel: What `parallelize` returned.
            path: A ``.safetensors`` file or a folder of them (index file or not).

        Returns:
            The checkpoint names the model has no entry for (ignored).
        """
        ...
