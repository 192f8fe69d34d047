"""`moe` (DeepShard's own) and `expert_parallel` (DeepSpeed AutoEP): mixture-of-experts settings.

DeepSpeed configures MoE layers in code (``deepspeed.moe.layer.MoE(num_experts=..., ep_size=...,
k=...)``) and has no JSON section for them; DeepShard adds the `moe` section so the expert-parallel
degree and the gating knobs live in the config with everything else. Its keys follow the
arguments of DeepSpeed's MoE layer (``top_k`` is DeepSpeed's ``k``). The `expert_parallel`
section is DeepSpeed 0.19.7's AutoEP section (expert parallelism applied to an existing HF MoE
model). Either one sets the ``ep`` axis of the Topology; if both do, they must agree.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from deepshard.interface.config._base import ConfigModel, raw_problems_error
from deepshard.interface.errors import ConfigError

__all__ = ["ExpertParallelConfig", "MoeConfig"]


class MoeConfig(ConfigModel):
    """The `moe` section: expert parallelism and token routing of MoE layers."""

    config_key = "moe"

    ep_size: int = Field(1, ge=1)
    """Expert-parallel degree: ranks the experts of a layer are spread over (Topology ``ep``)."""

    num_experts: int = Field(1, ge=1)
    """Experts per MoE layer; a multiple of ``ep_size``."""

    top_k: int = Field(1, ge=1)
    """Experts each token is routed to (DeepSpeed's ``k``)."""

    capacity_factor: float = Field(1.0, gt=0.0)
    """Training capacity per expert, as a multiple of the even share of tokens."""

    eval_capacity_factor: float = Field(1.0, gt=0.0)
    """Capacity factor at evaluation."""

    min_capacity: int = Field(4, ge=0)
    """Fewest tokens an expert can take, whatever the capacity factor."""

    drop_tokens: bool = True
    """Drop tokens beyond an expert's capacity (false: capacity grows to fit)."""

    use_rts: bool = True
    """Random token selection when an expert is over capacity (else first come first served)."""

    noisy_gate_policy: Literal["Jitter", "RSample"] | None = None
    """Noise added to the gate: multiplicative jitter on inputs, or sampled logits; None off."""

    use_residual: bool = False
    """Residual MoE: a dense MLP in parallel with the experts, mixed by a learned coefficient."""

    enable_expert_tensor_parallelism: bool = False
    """Split each expert across the tensor-parallel ranks as well."""

    top2_2nd_expert_sampling: bool = True
    """With top-2 gating, sample the second expert instead of taking the runner-up."""

    @model_validator(mode="after")
    def _experts_divide(self) -> MoeConfig:
        if self.num_experts % self.ep_size:
            message = f"num_experts {self.num_experts} is not a multiple of ep_size {self.ep_size}"
            raise raw_problems_error([("num_experts", message)])
        return self


class ExpertParallelConfig(ConfigModel):
    """The `expert_parallel` section: DeepSpeed AutoEP for existing HF MoE models."""

    config_key = "expert_parallel"

    enabled: bool = False
    """Replace the model's MoE blocks with expert-parallel ones."""

    autoep_size: int = Field(1, ge=1)
    """Expert-parallel degree (Topology ``ep``) when enabled."""

    expert_tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel degree inside each expert: 1 (experts whole on every ``tp`` rank) or the
    mesh's ``tp`` (each expert split over the same ranks as AutoTP's dense layers)."""

    validate_folding_routing: bool = False
    """Check at start-up that folded EP/TP groups route tokens consistently."""

    preset_model: str | None = None
    """Built-in description of a model family's MoE layout ("mixtral", "qwen3_moe", ...)."""

    moe_layer_pattern: str | None = None
    """Regex matching MoE block names, when no preset applies."""

    expert_pattern: str | None = None
    """Regex matching the experts container inside a MoE block."""

    router_pattern: str | None = None
    """Regex matching the router (gate) inside a MoE block."""

    use_grouped_mm: bool = True
    """Run experts with ``torch._grouped_mm`` where the operands allow it (CUDA; CPU once a
    one-time check against a per-expert loop agrees); False always loops over the experts."""

    disable_triton_grouped_mm: bool = False
    """Use the PyTorch grouped matmul even where a Triton kernel exists."""

    route_norm: bool | None = None
    """Renormalise the top-k routing weights to sum to one; None follows the model."""

    route_scale: float = Field(1.0, gt=0.0)
    """Multiplier applied to routing weights."""

    score_apply: Literal["auto", "pre", "post"] = "auto"
    """Apply routing weights before or after the expert computation; auto follows the model."""

    combine_impl: Literal["auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"] = "auto"
    """How expert outputs are combined."""

    comm_backend: Literal["comm", "deepep"] = "comm"
    """Token-dispatch backend: DeepShard's all-to-all ("comm"), or the DeepEP library ("deepep",
    bf16 only; needs ``deep_ep`` importable and ``comm_max_tokens_per_rank > 0``)."""

    comm_num_sm: int = Field(12, ge=1)
    """DeepEP only: streaming multiprocessors its kernels may occupy."""

    comm_qp_margin: int = Field(4, ge=0)
    """DeepEP only: extra RDMA queue pairs reserved beyond the minimum."""

    comm_max_tokens_per_rank: int = Field(0, ge=0)
    """DeepEP only: most tokens one rank routes per step (micro-batch × padded sequence
    length); sizes DeepEP's fixed buffers. 0 (the default) is refused with DeepEP."""

    num_expert_groups: int | None = Field(None, ge=1)
    """Group-limited routing: number of expert groups; None follows the model."""

    num_limited_groups: int | None = Field(None, ge=1)
    """Group-limited routing: groups a token may use; None follows the model."""

    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    """Router scoring function; auto follows the model."""

    top_k: PositiveInt | Literal["auto"] = "auto"
    """Experts per token; "auto" reads it from the model."""

    routed_scaling_factor: float | Literal["auto"] = "auto"
    """Scale of the routed-expert output; "auto" reads it from the model."""

    expert_w1: str | None = None
    """Attribute name of the experts' first (gate) projection, when no preset applies."""

    expert_w2: str | None = None
    """Attribute name of the experts' down projection."""

    expert_w3: str | None = None
    """Attribute name of the experts' up projection (None for two-matrix experts)."""

    num_experts_attr: str | None = None
    """Model-config attribute holding the number of experts."""

    top_k_attr: str | None = None
    """Model-config attribute holding top-k."""

    has_shared_experts: bool | None = None
    """Whether MoE blocks also have always-on shared experts; None detects it."""

    shared_experts_pattern: str | None = None
    """Regex matching the shared experts inside a MoE block."""

    shared_experts_gate_pattern: str | None = None
    """Regex matching the shared experts' gate."""

    @property
    def ep_size(self) -> int:
        """The expert-parallel degree this section asks for (1 when disabled)."""
        return self.autoep_size if self.enabled else 1

    @model_validator(mode="after")
    def _combinations(self) -> ExpertParallelConfig:
        problems = _combination_problems(self)
        if problems:
            raise raw_problems_error(problems)
        return self

    def check_num_experts(self, num_experts: int, *, layer: str = "") -> None:
        """Checks the section against a MoE layer's expert count, once the model is known.

        Args:
            num_experts: Experts of the layer.
            layer: The layer's module name, for the message.

        Raises:
            ConfigError: ``autoep_size`` or ``num_expert_groups`` does not divide the experts.
        """
        where = f" of {layer}" if layer else ""
        problems = [
            (
                f"{self.config_key}.{key}",
                f"{value} does not divide the {num_experts} experts{where}",
            )
            for key, value in (
                ("autoep_size", self.ep_size),
                ("num_expert_groups", self.num_expert_groups),
            )
            if value is not None and num_experts % value
        ]
        if problems:
            raise ConfigError.from_problems(problems)


def _combination_problems(section: ExpertParallelConfig) -> list[tuple[str, str]]:
    """Settings of the `expert_parallel` section that cannot work together."""
    problems: list[tuple[str, str]] = []
    fused = section.combine_impl == "fused_weighted_sum"
    deepep = section.comm_backend == "deepep"
    if fused and section.score_apply == "pre":
        message = "fused_weighted_sum applies the scores itself, so needs score_apply post or auto"
        problems.append(("combine_impl", message))
    if fused and deepep and section.autoep_size > 1:
        message = 'DeepEP combines the rows itself; use comm_backend "comm" with fused_weighted_sum'
        problems.append(("combine_impl", message))
    if deepep and section.expert_tensor_parallel_size > 1:
        message = 'DeepEP does not support expert tensor parallelism; use comm_backend "comm"'
        problems.append(("comm_backend", message))
    if deepep and section.comm_max_tokens_per_rank == 0:
        message = "must be > 0 with DeepEP: the most tokens one rank routes (micro-batch × seq len)"
        problems.append(("comm_max_tokens_per_rank", message))
    if deepep and section.enabled and importlib.util.find_spec("deep_ep") is None:
        message = 'DeepEP is not installed (no module deep_ep); install it or use "comm"'
        problems.append(("comm_backend", message))
    groups, limited = section.num_expert_groups, section.num_limited_groups
    if groups is not None and limited is not None and limited > groups:
        problems.append(("num_limited_groups", f"{limited} exceeds num_expert_groups {groups}"))
    return problems
