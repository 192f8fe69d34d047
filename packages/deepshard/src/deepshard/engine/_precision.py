"""Numeric precision of a run: the model's dtype, autocast around the forward, loss scaling.

Three ways to train, chosen by the config:

* **fp32** (nothing enabled): the model stays as it is (or is cast to ``data_types.param_dtype``).
* **bf16 / fp16** (``bf16.enabled`` / ``fp16.enabled``): the model's parameters and floating
  buffers are cast to the 16-bit dtype; ZeRO keeps fp32 master weights and fp32 optimizer state
  and copies the updated masters back into the 16-bit parameters after every step. fp16 also
  scales the loss (`deepshard.engine.loss_scaler`); ``fp16.auto_cast`` casts the floating
  inputs of ``forward`` to float16.
* **torch autocast** (``torch_autocast.enabled``): the parameters stay fp32 and the forward
  runs under ``torch.autocast``, in ``torch_autocast.dtype`` or, when that is None, the
  device's autocast default (float16 on CUDA, bfloat16 on CPU). In float16 the loss is scaled
  with the ``fp16`` section's scaling settings, as for fp16 training.

Every overflow check (inf/nan in the reduced gradients) is done by ZeRO at every precision: the
flag travels in the all-reduce that computes the gradient norm, so it costs nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.interface.config import DeepShardConfig
from deepshard.zero import torch_dtype

__all__ = ["Precision", "plan_precision"]


@dataclass(frozen=True)
class Precision:
    """What the engine does about precision.

    Attributes:
        param_dtype: The dtype the model's parameters are cast to; ``None`` keeps them.
        buffer_dtype: The dtype floating buffers are cast to; ``None`` follows ``param_dtype``.
        autocast_dtype: ``torch.autocast`` dtype around the forward; ``None`` for no autocast.
        cast_inputs: ``fp16.auto_cast``: cast floating inputs of the forward to float16.
        loss_scaled: Whether the loss is scaled (the run computes in float16).
    """

    param_dtype: torch.dtype | None
    buffer_dtype: torch.dtype | None
    autocast_dtype: torch.dtype | None
    cast_inputs: bool
    loss_scaled: bool

    def cast_model(self, module: torch.nn.Module, device: torch.device) -> None:
        """Move ``module`` to ``device`` and cast it (the parameter objects are kept).

        Args:
            module: The model; optimizers already built on its parameters stay valid.
            device: The training device.
        """
        module.to(device=device, dtype=self.param_dtype)
        if self.buffer_dtype is None:
            return
        for buffer in module.buffers():
            if buffer.is_floating_point():
                buffer.data = buffer.data.to(self.buffer_dtype)

    @contextlib.contextmanager
    def forward_context(self, device_type: str) -> Iterator[None]:
        """``torch.autocast`` when configured, else nothing."""
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type, dtype=self.autocast_dtype):
            yield

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """The forward's arguments, floating tensors cast to float16 under ``fp16.auto_cast``."""
        if not self.cast_inputs:
            return args, kwargs
        return _to_half(args), _to_half(kwargs)


def _to_half(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.half() if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_to_half(item) for item in value)
    if isinstance(value, list):
        return [_to_half(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_half(item) for key, item in value.items()}
    return value


def plan_precision(config: DeepShardConfig, device_type: str) -> Precision:
    """Reads the precision sections of a config (already checked by `check_engine_config`).

    Args:
        config: The whole config.
        device_type: ``"cpu"``, ``"cuda"``...: decides autocast's default dtype.

    Returns:
        The plan.
    """
    if config.fp16.enabled:
        param_dtype: torch.dtype | None = torch.float16
    elif config.bf16.enabled:
        param_dtype = torch.bfloat16
    else:
        param_dtype = torch_dtype(config.data_types.param_dtype, key="data_types.param_dtype")
    autocast_dtype = None
    if config.torch_autocast.enabled:
        autocast_dtype = torch_dtype(
            config.torch_autocast.dtype, key="torch_autocast.dtype"
        ) or torch.get_autocast_dtype(device_type)
    loss_scaled = param_dtype == torch.float16 or autocast_dtype == torch.float16
    return Precision(
        param_dtype=param_dtype,
        buffer_dtype=torch_dtype(config.data_types.buffer_dtype, key="data_types.buffer_dtype"),
        autocast_dtype=autocast_dtype,
        cast_inputs=config.fp16.enabled and config.fp16.auto_cast,
        loss_scaled=loss_scaled,
    )
