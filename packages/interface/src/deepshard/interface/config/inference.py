"""The `init_inference` config: DeepSpeed-Inference's keys for evaluation and generation.

This is not a section of the training config: ``deepshard.inference.init_inference(model,
config, **kwargs)`` validates its ``config`` (and keyword arguments) against `InferenceConfig`.
DeepSpeed's key names are kept (``max_out_tokens`` or ``max_tokens``, ``tensor_parallel`` or
``tp``, the deprecated top-level ``mp_size``); what DeepShard does not carry is refused by name.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from deepshard.interface.config._base import ConfigModel, must_stay_false, raw_problems_error
from deepshard.interface.config._dtypes import DtypeName, normalize_dtype
from deepshard.interface.config._removed import KERNEL_INJECT_MESSAGE

__all__ = ["InferenceConfig", "InferenceTensorParallelConfig"]


class InferenceTensorParallelConfig(ConfigModel):
    """`tensor_parallel` of the inference config: how many ranks one model is split across."""

    config_key = "tensor_parallel"
    drops_auto = True

    enabled: bool = True
    """Split the model when ``tp_size`` > 1 (DeepSpeed's key; false keeps it whole)."""

    tp_size: int = Field(1, ge=1)
    """Ranks the model is split across (adjacent ranks of the world form one group)."""

    tp_grain_size: int = Field(1, ge=1)
    """Granularity (elements) that MLP / lm_head shards are rounded to."""

    @property
    def size(self) -> int:
        """The effective tensor-parallel degree: ``tp_size``, or 1 when not enabled."""
        return self.tp_size if self.enabled else 1


class InferenceConfig(ConfigModel):
    """What `deepshard.inference.init_inference` accepts, with DeepSpeed's key names.

    ``dtype`` casts the model (None keeps its dtype; DeepSpeed casts to fp16 by default, which
    on a CPU is rarely what one wants). ``max_out_tokens`` must be positive: DeepSpeed accepted
    -1 and then failed on every generate.
    """

    config_key = ""
    drops_auto = True

    dtype: DtypeName | None = None
    """Dtype the model is cast to ("fp32", "fp16", "bf16" or a ``torch`` dtype); None keeps it."""

    tensor_parallel: InferenceTensorParallelConfig = Field(
        default_factory=InferenceTensorParallelConfig, alias="tp"
    )
    """Tensor parallelism; ``tp_size`` > 1 needs a parallelizer (``deepshard.engine.init_inference``
    supplies AutoTP's)."""

    max_out_tokens: int = Field(1024, gt=0, alias="max_tokens")
    """Longest sequence (prompt and new tokens) the KV cache holds; must be positive."""

    min_out_tokens: int = Field(1, ge=0, alias="min_tokens")
    """Fewest new tokens a generate is expected to produce (at most ``max_out_tokens``)."""

    max_batch_size: int | None = Field(None, ge=1)
    """Rows decoded together by continuous batching; None uses the batch given to ``generate``."""

    keep_module_on_host: bool = False
    """Leave the module (and checkpoint tensors) on the host instead of moving it to the device."""

    enable_cuda_graph: bool = False
    """Capture the decode step in a CUDA graph; refused where it cannot be done (see the engine)."""

    checkpoint: str | None = None
    """A safetensors file, a directory of them (``model.safetensors.index.json`` for sharded
    ones) or a DeepShard ``save_16bit_model`` output, read tensor by tensor onto the layout."""

    enable_profiling: bool = False
    """Record prefill and decode forward times, forwards, tokens and tokens/s."""

    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    """Must stay false: DeepSpeed-Inference kernel injection is not carried."""

    @model_validator(mode="before")
    @classmethod
    def _move_mp_size(cls, data: Any) -> Any:
        """DeepSpeed's deprecated top-level ``mp_size`` is ``tensor_parallel.tp_size``."""
        if not isinstance(data, dict) or "mp_size" not in data:
            return data
        data = dict(data)
        mp_size = data.pop("mp_size")
        key = "tp" if "tp" in data else "tensor_parallel"
        section = data.get(key)
        if section is None:
            data[key] = {"tp_size": mp_size}
            return data
        if not isinstance(section, dict):
            section = section.model_dump() if hasattr(section, "model_dump") else section
        if isinstance(section, dict) and section.get("tp_size", mp_size) != mp_size:
            raise raw_problems_error(
                [
                    (
                        "mp_size",
                        f"{mp_size} disagrees with {key}.tp_size={section['tp_size']}; "
                        "keep only tensor_parallel.tp_size",
                    )
                ]
            )
        if isinstance(section, dict):
            data[key] = {**section, "tp_size": mp_size}
        return data

    @field_validator("dtype", mode="before")
    @classmethod
    def _canonical(cls, value: object) -> object:
        # A torch dtype prints as "torch.float16", a spelling normalize_dtype knows; the interface
        # never imports torch to recognise one.
        if value is not None and not isinstance(value, str) and type(value).__name__ == "dtype":
            value = str(value)
        return normalize_dtype(value)

    _refuse_injection = must_stay_false("replace_with_kernel_inject", KERNEL_INJECT_MESSAGE)

    @model_validator(mode="after")
    def _check_token_bounds(self) -> InferenceConfig:
        if self.min_out_tokens > self.max_out_tokens:
            raise raw_problems_error(
                [
                    (
                        "min_out_tokens",
                        f"{self.min_out_tokens} exceeds max_out_tokens={self.max_out_tokens}; "
                        "lower it or raise max_out_tokens",
                    )
                ]
            )
        return self
