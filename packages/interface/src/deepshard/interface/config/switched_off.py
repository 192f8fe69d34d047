"""DeepSpeed sections DeepShard accepts only switched off: `compile` and `hybrid_engine`.

Frameworks write these blocks into every config they generate, with the feature off:
OpenRLHF emits ``"compile": {"deepcompile": false}`` and DeepSpeed-Chat emits
``"hybrid_engine": {"enabled": false, ...}``. Switched off, DeepSpeed 0.19.7 parses them and
does nothing with them, so DeepShard accepts them the same way (every key checked against the
section's schema, as DeepSpeed checks it, none acted on). Switched on, they ask for a feature
DeepShard does not carry, and the config is refused with the alternative (as `AmpConfig`
refuses apex).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from deepshard.interface.config._base import ConfigModel, must_stay_false
from deepshard.interface.config._removed import DEEPCOMPILE_MESSAGE, HYBRID_ENGINE_MESSAGE

__all__ = ["CompileConfig", "HybridEngineConfig"]


class CompileConfig(ConfigModel):
    """The `compile` section (DeepCompile). Accepted only with `deepcompile` false."""

    config_key = "compile"
    drops_auto = True

    deepcompile: bool = False
    """Must stay false: DeepShard does not carry DeepCompile (call ``torch.compile`` on the
    model before ``initialize``)."""

    free_activation: bool = False
    """DeepCompile: free activations early. Unused."""

    free_activation_threshold: int = Field(10 * 1024 * 1024, ge=0)
    """DeepCompile: smallest activation (bytes) freed early. Unused."""

    offload_activation: bool = False
    """DeepCompile: move saved activations to host memory. Unused."""

    offload_activation_pin_memory: bool = True
    """DeepCompile: pin the host buffers of activation offload. Unused."""

    offload_opt_states: bool = False
    """DeepCompile: move optimizer state to host memory between steps. Unused."""

    double_buffer: bool = True
    """DeepCompile: double-buffered parameter gathers. Unused."""

    symmetric_memory: bool = False
    """DeepCompile: symmetric-memory collectives. Unused."""

    debug_log: bool = False
    """DeepCompile: dump its graphs. Unused."""

    offload_parameters: bool = False
    """DeepCompile: parameter offload. Unused."""

    sync_before_reduce: bool = False
    """DeepCompile: synchronise before gradient reduction. Unused."""

    sync_after_reduce: bool = False
    """DeepCompile: synchronise after gradient reduction. Unused."""

    sync_before_allgather: bool = False
    """DeepCompile: synchronise before parameter gathers. Unused."""

    sync_after_allgather: bool = False
    """DeepCompile: synchronise after parameter gathers. Unused."""

    keep_int_input_tensors: bool = True
    """DeepCompile: keep integer graph inputs as real values. Unused."""

    keep_all_input_tensors: bool = False
    """DeepCompile: keep every graph input as a real value. Unused."""

    passes: list[Literal["z1", "z3", "autosp", "autotp"]] | None = None
    """DeepCompile: the optimisation passes to compose. Unused."""

    _refuse_deepcompile = must_stay_false("deepcompile", DEEPCOMPILE_MESSAGE)


class HybridEngineConfig(ConfigModel):
    """The `hybrid_engine` section (RLHF generation). Accepted only with `enabled` false."""

    config_key = "hybrid_engine"
    drops_auto = True

    enabled: bool = False
    """Must stay false: DeepShard generates rollouts with ``deepshard.inference``'s
    ``build_rollout(config, engine, tokenizer)`` instead."""

    max_out_tokens: int = Field(512, gt=0)
    """Hybrid engine: most tokens one generation returns. Unused."""

    inference_tp_size: int = Field(1, ge=1)
    """Hybrid engine: tensor-parallel size while generating. Unused."""

    release_inference_cache: bool = False
    """Hybrid engine: free the generation cache after each rollout. Unused."""

    pin_parameters: bool = True
    """Hybrid engine: pin gathered parameters. Unused."""

    tp_gather_partition_size: int = Field(8, ge=1)
    """Hybrid engine: layers gathered at once under ZeRO-3. Unused (`build_rollout` has its
    own bound)."""

    enable_cuda_graph: bool = False
    """Hybrid engine: CUDA-graph the generation step. Unused."""

    _refuse_hybrid_engine = must_stay_false("enabled", HYBRID_ENGINE_MESSAGE)
