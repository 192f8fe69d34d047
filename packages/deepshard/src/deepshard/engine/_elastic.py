"""The batch sizes the engine trains with: the config's, or elasticity's for this world.

With ``elasticity.enabled`` the global batch, micro-batch and accumulation steps come from
`deepshard.interface.elasticity.elastic_batch` for the data-parallel world size (the top-level
batch keys are absent, or ignored with ``ignore_non_elastic_batch_info``). The choice lives in
the engine's own `BatchSizes`; the caller's config dict is never written to (DeepSpeed 0.19.7
fixed its engine writing the elastic values into the user's dict).
"""

from __future__ import annotations

import logging

from deepshard.interface import BatchSizes, DeepShardConfig, resolve_batch_sizes
from deepshard.interface.elasticity import elastic_batch

__all__ = ["engine_batch_sizes"]

_log = logging.getLogger("deepshard.engine")


def engine_batch_sizes(config: DeepShardConfig, dp_world_size: int) -> BatchSizes:
    """The reconciled batch sizes for ``dp_world_size`` ranks reading their own samples.

    Raises:
        ConfigError: The batch keys disagree with the world, or (elastic) the world size is
            not one of the valid GPU counts.
    """
    if not config.elasticity.enabled:
        return config.resolve_batch(dp_world_size)
    chosen = elastic_batch(config, dp_world_size)
    _log.info(
        "elasticity: train_batch_size %d, micro-batch %d, accumulation %d for %d ranks "
        "(valid data-parallel sizes: %s)",
        chosen.train_batch_size,
        chosen.micro_batch_size,
        chosen.gradient_accumulation_steps,
        dp_world_size,
        list(chosen.valid_gpus),
    )
    return resolve_batch_sizes(
        chosen.train_batch_size,
        chosen.micro_batch_size,
        chosen.gradient_accumulation_steps,
        dp_world_size,
    )
