"""`fp16`, `bf16` (alias `bfloat16`), `data_types`, `torch_autocast`, `amp`: numeric precision."""

from __future__ import annotations

import math

from pydantic import AliasChoices, Field, field_validator, model_validator

from deepshard.interface.config._base import ConfigModel, must_stay_false, raw_problems_error
from deepshard.interface.config._dtypes import DtypeName, normalize_dtype
from deepshard.interface.config._removed import AMP_ENABLED_MESSAGE

__all__ = ["AmpConfig", "Bf16Config", "DataTypesConfig", "Fp16Config", "TorchAutocastConfig"]


class Fp16Config(ConfigModel):
    """The `fp16` section: float16 mixed precision with static or dynamic loss scaling."""

    config_key = "fp16"
    drops_auto = True

    enabled: bool = False
    """Train with float16 weights and activations, fp32 master weights in the optimizer."""

    auto_cast: bool = False
    """Cast floating-point inputs of the model's forward to float16."""

    loss_scale: float = Field(0.0, ge=0.0)
    """Static loss scale; 0 selects dynamic loss scaling (the scale adapts to overflows)."""

    initial_scale_power: int = Field(16, ge=0)
    """Dynamic scaling starts at ``2 ** initial_scale_power``."""

    loss_scale_window: int = 1000
    """Overflow-free steps after which the dynamic scale is doubled. Must be positive when
    dynamic scaling is on (``enabled`` and ``loss_scale == 0``); unchecked otherwise, as in
    DeepSpeed, because it is then unused."""

    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale is halved (delayed shift). Deliberate
    deviation: DeepSpeed sets no bound, but with dynamic scaling on a value below 1 means the
    scale is never lowered on overflow (every later step is skipped), so DeepShard refuses it
    then; unchecked while dynamic scaling is off."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every overflow-free step, not only at window ends."""

    min_loss_scale: int | float = 1
    """Floor of the dynamic loss scale. DeepSpeed types it int; DeepShard accepts a fraction too
    (e.g. ``0.5``). Must be positive when dynamic scaling is on; unchecked otherwise."""

    fp16_master_weights_and_grads: bool = False
    """Keep the ZeRO master weights and the reduced gradients in fp16 (2 bytes each instead of
    4), stepped with fp32 moments on the host: needs ``enabled``, ZeRO stage 1-3 and
    ``offload_optimizer`` (the CPU Adam kernel), as DeepSpeed."""

    @field_validator("loss_scale", "min_loss_scale")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise raw_problems_error([("", f"must be a finite number; got {value}")])
        return value

    @model_validator(mode="after")
    def _dynamic_scaling_bounds(self) -> Fp16Config:
        if not (self.enabled and self.dynamic_loss_scale):
            return self
        why = "with dynamic loss scaling on (enabled, loss_scale 0)"
        problems: list[tuple[str, str]] = []
        if self.loss_scale_window <= 0:
            problems.append(
                ("loss_scale_window", f"must be > 0 {why}; got {self.loss_scale_window}")
            )
        if self.min_loss_scale <= 0:
            problems.append(("min_loss_scale", f"must be > 0 {why}; got {self.min_loss_scale}"))
        if self.hysteresis < 1:
            problems.append(
                (
                    "hysteresis",
                    f"must be >= 1 {why}, else the scale never drops on overflow; "
                    f"got {self.hysteresis}",
                )
            )
        if problems:
            raise raw_problems_error(problems)
        return self

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the loss scale adapts to overflows (``loss_scale == 0``)."""
        return self.loss_scale == 0.0


class Bf16Config(ConfigModel):
    """The `bf16` section (also accepted as `bfloat16`): bfloat16 mixed precision."""

    config_key = "bf16"
    drops_auto = True

    enabled: bool = False
    """Train with bfloat16 weights and activations, fp32 master weights in the optimizer."""

    immediate_grad_update: bool = False
    """Apply each gradient to the fp32 accumulator as soon as it is produced."""

    check_grad_overflow: bool = Field(
        True, validation_alias=AliasChoices("check_grad_overflow", "check_overflow")
    )
    """Check gradients for inf/nan before the optimizer step and skip the step if found. On by
    default, as for fp16; ``check_overflow`` is accepted as the older spelling."""

    bf16_master_weights_and_grads: bool = False
    """Keep the ZeRO master weights and the reduced gradients in bf16 (2 bytes each instead of
    4), at ZeRO stages 1-3 on a bf16 model (``enabled``): with ``bf16_optimizer_states`` on the
    device, or stepped on the host by CPU Adam (``offload_optimizer``), as DeepSpeed."""

    bf16_optimizer_states: bool = False
    """Keep the optimizer states in bf16 too (needs ``bf16_master_weights_and_grads``): the inner
    optimizer steps bf16 masters and allocates its moments like them; with optimizer offload the
    CPU Adam kernel keeps bf16 moments."""


class DataTypesConfig(ConfigModel):
    """The `data_types` section: dtypes of gradient accumulation, parameters and buffers."""

    config_key = "data_types"

    grad_accum_dtype: DtypeName | None = None
    """Dtype gradients are accumulated in across micro-batches; None follows the training dtype.
    Any DeepSpeed spelling (``"float32"``, ``"bfloat16"``, ``"half"``, ...) is accepted."""

    param_dtype: DtypeName | None = None
    """Dtype the model parameters are cast to; None keeps them as loaded."""

    buffer_dtype: DtypeName | None = None
    """Dtype the model buffers are cast to; None keeps them as loaded."""

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")
    @classmethod
    def _canonical(cls, value: object) -> object:
        return normalize_dtype(value)


class TorchAutocastConfig(ConfigModel):
    """The `torch_autocast` section: run the forward under ``torch.autocast``."""

    config_key = "torch_autocast"

    enabled: bool = False
    """Wrap the forward pass in ``torch.autocast`` on the training device."""

    dtype: DtypeName | None = None
    """Lower-precision dtype autocast uses; None lets ``torch.autocast`` pick the device's
    default (float16 on CUDA, bfloat16 on CPU)."""

    lower_precision_safe_modules: list[str] | None = None
    """Fully qualified module classes whose parameters may be kept in the autocast dtype, e.g.
    ``["torch.nn.modules.linear.Linear"]``; None uses the default list."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _canonical(cls, value: object) -> object:
        return normalize_dtype(value)


class AmpConfig(ConfigModel):
    """The `amp` section (NVIDIA apex AMP). Accepted only switched off; enabling it is refused."""

    config_key = "amp"

    enabled: bool = False
    """Must stay false: DeepShard does not carry apex AMP (use `bf16` or `fp16`)."""

    opt_level: str | None = None
    """apex optimisation level (``"O1"``...), accepted so that old configs parse; unused."""

    _refuse_apex = must_stay_false("enabled", AMP_ENABLED_MESSAGE)
