"""The classic MoE layer: DeepSpeed's ``deepspeed.moe.layer.MoE``, for code written against it.

``MoE(hidden_size, expert, num_experts, k=...)`` copies ``expert`` ``num_experts`` times, routes
each token with DeepSpeed's GShard gating (`deepshard.autoep._gating`), runs every expert on the
routes it kept and combines them, returning ``(output, l_aux, exp_counts)`` as DeepSpeed does.

Where DeepSpeed scatters tokens into a zero-padded ``[E, capacity, H]`` buffer and runs every
expert on all ``capacity`` rows, the routes here are stably sorted by expert (dropped routes
last) and each expert runs on exactly the rows it kept; `combine` restores token order with the
gate weights (dropped routes read a zero row with weight 0). The arithmetic per kept row is the
same, without the padding.

Expert parallelism (``ep_size > 1``) is not built into this layer yet; it is refused with a
`ConfigError` rather than silently run on one rank.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.autoep._combine import CombineImpl, combine, sort_by_expert
from deepshard.autoep._gating import Gating, gshard_gating
from deepshard.interface.config.moe import MoeConfig
from deepshard.interface.errors import ConfigError

__all__ = ["MoE"]

# DeepSpeed's multiplicative jitter: gate inputs scaled by U(1 - eps, 1 + eps) while training.
_JITTER_EPS = 1e-2


class MoE(nn.Module):
    """A mixture-of-experts layer with DeepSpeed's arguments and outputs.

    Args:
        hidden_size: Input and output width.
        expert: The expert module (deep-copied ``num_experts`` times); maps ``[N, H]`` to
            ``[N, H]`` (a tuple output's first element is used, as DeepSpeed does).
        num_experts: Experts in the layer.
        ep_size: Expert-parallel degree; only 1 is built into this layer so far.
        k: Experts per token (1, 2 or more).
        capacity_factor: Training capacity, as a multiple of the even share of routes.
        eval_capacity_factor: The same at evaluation.
        min_capacity: Fewest routes an expert accepts, whatever the factor.
        drop_tokens: Drop routes beyond capacity (False: nothing is dropped).
        use_residual: Residual MoE: ``expert`` itself also runs densely, mixed by a learned
            two-way softmax coefficient.
        noisy_gate_policy: ``"Jitter"`` (multiplicative input noise), ``"RSample"`` (Gumbel
            noise on top-1's choice), or None (DeepSpeed's ``"None"`` too); training only.
        use_rts: Top-1: drop a random subset of an over-full expert's tokens.
        top2_2nd_expert_sampling: Top-2: sample the second expert (Gumbel) while training.
        combine_impl: ``"weighted_sum"`` or ``"fused_weighted_sum"`` (deepshard-kernels' op).

    Raises:
        ConfigError: An argument is out of range (the message names it as a ``moe`` key).
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        drop_tokens: bool = True,
        use_residual: bool = False,
        noisy_gate_policy: Literal["Jitter", "RSample", "None"] | None = None,
        *,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
        combine_impl: CombineImpl = "weighted_sum",
    ) -> None:
        super().__init__()
        # MoeConfig checks ranges and names the keys; "None" is DeepSpeed's spelling of off.
        policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.config = MoeConfig(
            ep_size=ep_size, num_experts=num_experts, top_k=k, capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor, min_capacity=min_capacity,
            drop_tokens=drop_tokens, use_rts=use_rts, noisy_gate_policy=policy,
            use_residual=use_residual, top2_2nd_expert_sampling=top2_2nd_expert_sampling,
        )  # fmt: skip
        _refuse_unbuilt(self.config, combine_impl)
        self.hidden_size = hidden_size
        self.combine_impl: CombineImpl = combine_impl
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_experts))
        self.mlp = expert if use_residual else None
        self.coefficient = nn.Linear(hidden_size, 2) if use_residual else None

    @classmethod
    def from_config(
        cls, config: MoeConfig, hidden_size: int, expert: nn.Module, **options: bool | str
    ) -> MoE:
        """Builds the layer from the config's `moe` section (``options``: the keyword-only ones)."""
        return cls(
            hidden_size, expert, config.num_experts, config.ep_size, config.top_k,
            config.capacity_factor, config.eval_capacity_factor, config.min_capacity,
            config.drop_tokens, config.use_residual, config.noisy_gate_policy,
            use_rts=config.use_rts, top2_2nd_expert_sampling=config.top2_2nd_expert_sampling,
            **options,  # type: ignore[arg-type]
        )  # fmt: skip

    def forward(
        self, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routes, runs the experts and combines.

        Args:
            hidden_states: ``[..., hidden_size]`` tokens.

        Returns:
            ``(output, l_aux, exp_counts)``: output shaped like the input, the scalar fp32
            auxiliary loss, and the ``[num_experts]`` int64 routes per expert before drops.
        """
        tokens = hidden_states.reshape(-1, self.hidden_size)
        gating = self.route(tokens)
        output = self._experts_and_combine(tokens, gating).view(hidden_states.shape)
        if self.mlp is not None and self.coefficient is not None:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            mix = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + dense * mix[..., 1:]
        return output, gating.l_aux, gating.exp_counts

    def route(self, tokens: torch.Tensor) -> Gating:
        """The gate's decision for ``[T, hidden_size]`` tokens (fp32, noise while training)."""
        config = self.config
        gate_input = tokens.float()
        if self.training and config.noisy_gate_policy == "Jitter":
            noise = torch.empty_like(gate_input).uniform_(1 - _JITTER_EPS, 1 + _JITTER_EPS)
            gate_input = gate_input * noise
        logits = F.linear(gate_input, self.gate.weight.float())
        factor = config.capacity_factor if self.training else config.eval_capacity_factor
        return gshard_gating(
            logits, k=config.top_k, capacity_factor=factor, min_capacity=config.min_capacity,
            drop_tokens=config.drop_tokens, use_rts=config.use_rts,
            rsample=self.training and config.noisy_gate_policy == "RSample",
            second_expert_sampling=self.training and config.top2_2nd_expert_sampling,
        )  # fmt: skip

    def _experts_and_combine(self, tokens: torch.Tensor, gating: Gating) -> torch.Tensor:
        """Runs each expert on the rows it kept (every expert runs, on 0 rows if need be)."""
        num_experts = len(self.experts)
        # Dropped routes go to a pseudo-expert past the last one: sorted last, never computed.
        ids = torch.where(gating.kept, gating.expert_ids, num_experts)
        order = sort_by_expert(ids, num_experts + 1)
        rows_in = tokens.index_select(0, order.token_of_row)
        sizes = order.counts.tolist()
        outputs = []
        for expert, chunk in zip(self.experts, torch.split(rows_in, sizes), strict=False):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        dtype = outputs[0].dtype if outputs else tokens.dtype
        outputs.append(tokens.new_zeros(sizes[-1], tokens.shape[-1], dtype=dtype))
        return combine(torch.cat(outputs), gating.weights, order.index, impl=self.combine_impl)


def _refuse_unbuilt(config: MoeConfig, combine_impl: str) -> None:
    """Refuses what this layer does not do (yet), naming the key and the way out."""
    if config.ep_size > 1:
        raise ConfigError(
            f"moe.ep_size: {config.ep_size}: the classic MoE layer runs its experts on one rank "
            "so far; use ep_size=1 (expert parallelism comes with deepshard.autoep's "
            "parallelize_experts)"
        )
    if config.top_k > config.num_experts:
        raise ConfigError(
            f"moe.top_k: k={config.top_k} exceeds num_experts={config.num_experts}; a token "
            "cannot choose more experts than the layer has"
        )
    if combine_impl not in ("weighted_sum", "fused_weighted_sum"):
        raise ConfigError(
            f"combine_impl: {combine_impl!r}: use 'weighted_sum' or 'fused_weighted_sum'"
        )
