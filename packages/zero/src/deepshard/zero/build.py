"""`build_zero_optimizer`: a `ZeroOptimizer` from a whole DeepSpeed config, for the engine."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepshard.comm import CommsLogger, Group
from deepshard.interface import DeepShardConfig, PlacementRegistry
from deepshard.interface.errors import ConfigError
from deepshard.zero._full_grads import FullGradTransform
from deepshard.zero._offload_plan import offload_problems
from deepshard.zero._optimizer_check import optimizer_problems
from deepshard.zero._resident import ResidentModule
from deepshard.zero._sharded import ShardedModule
from deepshard.zero._stage3_optimizer import Stage3Optimizer
from deepshard.zero.optimizer import ZeroOptimizer
from deepshard.zero.reduction import GradientReduction, torch_dtype

__all__ = ["build_zero_optimizer", "optimizer_side_problems"]


def optimizer_side_problems(
    optimizer: torch.optim.Optimizer, config: DeepShardConfig, *, transformed: bool
) -> list[tuple[str, str]]:
    """What the optimizer side refuses about ``optimizer`` under ``config``, as ``(key path,
    message)``: an optimizer not known to be element-wise (without
    ``zero_allow_untested_optimizer`` or a full-gradient transform) and what offload cannot
    step on the host. The engine checks it before `deepshard.zero.shard` changes the model.

    Args:
        optimizer: The inner optimizer.
        config: The whole config.
        transformed: A full-gradient transform (Muon) will be given.
    """
    allow = config.zero_allow_untested_optimizer or transformed
    problems = optimizer_problems(optimizer, allow_untested=allow)
    force = config.zero_force_ds_cpu_optimizer
    return problems + offload_problems(config.zero_optimization, optimizer, force, transformed)


def build_zero_optimizer(
    optimizer: torch.optim.Optimizer,
    config: DeepShardConfig,
    *,
    group: Group,
    comms_logger: CommsLogger | None = None,
    named_parameters: Iterable[tuple[str, torch.Tensor]] = (),
    placements: PlacementRegistry | None = None,
    full_grad_transform: FullGradTransform | None = None,
    transformed_params: Iterable[torch.Tensor] = (),
    sharded_module: ShardedModule | ResidentModule | None = None,
) -> ZeroOptimizer:
    """Wrap ``optimizer`` as the config says.

    Reads ``zero_optimization``, ``gradient_clipping``, ``gradient_allreduce_op``,
    ``prescale_gradients``, ``gradient_predivide_factor``, ``communication_data_type``,
    ``data_types.grad_accum_dtype``, ``zero_allow_untested_optimizer``, ``aio``,
    ``zero_force_ds_cpu_optimizer`` (optimizer offload) and the 16-bit master and state switches
    (`_precision`). Loss scaling
    (``fp16``) stays with the caller, which passes the scale to ``step``.

    Args:
        optimizer: The inner optimizer, built on the model's parameters.
        config: The whole config.
        group: The data-parallel group of the dense parameters.
        comms_logger: Records every collective.
        named_parameters: Names for the shard maps, e.g. ``model.named_parameters()``.
        placements: Every parameter's placement; ``group`` is their reduction group (see
            `ZeroOptimizer`).
        full_grad_transform: ``(grad, buffer, param_group) -> update`` on the full reduced
            gradient of each of ``transformed_params`` at every step, e.g. Muon's
            ``muon_update`` with the momentum as the buffer (see `ZeroOptimizer`).
        transformed_params: Whole param groups of ``optimizer`` to transform (Muon's
            ``use_muon`` groups).
        sharded_module: The model side (`deepshard.zero.shard` with the policy of the same
            config, `deepshard.zero.zero_policy`): a `ShardedModule` at stage 3, a
            `ResidentModule` at stages 0-2; the group and gradient settings then live in its
            policy. ``None`` at stages 0-2: the params-only form over ``group``.

    Returns:
        The wrapper; call its ``backward`` and ``step``.

    Raises:
        ConfigError: As `ZeroOptimizer` does; stage 3 without a `ShardedModule`, stages 0-2
            with one.
    """
    stage = config.zero_optimization.stage
    if stage == 3 or isinstance(sharded_module, ShardedModule):
        if stage != 3:
            raise ConfigError.from_problems(
                [("zero_optimization.stage", f"is {stage} but the model was sharded at stage 3")]
            )
        return _stage3(
            optimizer,
            config,
            sharded_module,
            comms_logger,
            full_grad_transform=full_grad_transform,
            transformed_params=transformed_params,
        )
    master_dtype, state_dtype = _precision(config)
    common: dict[str, Any] = {
        "config": config.zero_optimization,
        "gradient_clipping": config.gradient_clipping,
        "zero_allow_untested_optimizer": config.zero_allow_untested_optimizer,
        "full_grad_transform": full_grad_transform,
        "transformed_params": transformed_params,
        "aio": config.aio,
        "zero_force_ds_cpu_optimizer": config.zero_force_ds_cpu_optimizer,
        "master_dtype": master_dtype,
        "state_dtype": state_dtype,
    }
    if sharded_module is not None:
        return ZeroOptimizer(optimizer, sharded_module, **common)
    reduction = GradientReduction.from_names(
        op=config.gradient_allreduce_op,
        prescale=config.prescale_gradients,
        predivide_factor=config.gradient_predivide_factor,
        dtype=config.communication_data_type,
    )
    accum = torch_dtype(config.data_types.grad_accum_dtype, key="data_types.grad_accum_dtype")
    return ZeroOptimizer(
        optimizer,
        group=group,
        reduction=reduction,
        grad_accum_dtype=accum,
        comms_logger=comms_logger,
        named_parameters=named_parameters,
        placements=placements,
        **common,
    )


def _stage3(
    optimizer: torch.optim.Optimizer,
    config: DeepShardConfig,
    sharded: ShardedModule | ResidentModule | None,
    comms_logger: CommsLogger | None,
    *,
    full_grad_transform: FullGradTransform | None,
    transformed_params: Iterable[torch.Tensor],
) -> ZeroOptimizer:
    if not isinstance(sharded, ShardedModule):
        raise ConfigError.from_problems(
            [
                (
                    "zero_optimization.stage",
                    "3 needs the model sharded at stage 3 first: pass sharded_module=shard(model, "
                    "policy=ZeroPolicy(stage=3), ...)",
                )
            ]
        )
    master_dtype, state_dtype = _precision(config)
    return Stage3Optimizer(
        optimizer,
        sharded,
        config=config.zero_optimization,
        gradient_clipping=config.gradient_clipping,
        zero_allow_untested_optimizer=config.zero_allow_untested_optimizer,
        comms_logger=comms_logger,
        full_grad_transform=full_grad_transform,
        transformed_params=transformed_params,
        aio=config.aio,
        zero_force_ds_cpu_optimizer=config.zero_force_ds_cpu_optimizer,
        master_dtype=master_dtype,
        state_dtype=state_dtype,
    )


def _precision(config: DeepShardConfig) -> tuple[torch.dtype, torch.dtype | None]:
    """``master_dtype`` and ``state_dtype`` for the optimizer, as the config asks: bf16 masters
    (``bf16.bf16_master_weights_and_grads``), fp16 ones (``fp16.fp16_master_weights_and_grads``)
    or fp32; bf16 offloaded moments with ``bf16.bf16_optimizer_states``, else the optimizer's."""
    master = torch.float32
    if config.bf16.bf16_master_weights_and_grads:
        master = torch.bfloat16
    elif config.fp16.fp16_master_weights_and_grads:
        master = torch.float16
    states = torch.bfloat16 if config.bf16.bf16_optimizer_states else None
    return master, states
