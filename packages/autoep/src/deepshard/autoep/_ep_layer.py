"""The expert-parallel MoE block that replaces a Hugging Face one.

Forward, for hidden states ``[B, S, H]`` (``T = B·S`` tokens):

1. *Logits.* The block's own router module runs unchanged, so its output ``[0]`` (the logits)
   is what transformers records for the auxiliary load-balancing loss
   (``output_router_logits=True``), exactly as in the unreplaced model.
2. *Routing.* `route` computes the top-k experts and weights in fp32 from those logits, with
   the preset's knobs and the block's correction bias (DeepSeek-V3).
3. *Experts.* Rows are sorted by expert, dispatched to the ranks owning their experts, run
   through the local `GroupedExperts`, sent back and unsorted (`_dispatch`). With the default
   transport the rows a rank routes to its own experts never enter the exchange: they run
   while the other rows travel (`_overlap`, forward and backward; ``overlap_exchange = False``
   gives the plain exchange). Under expert tensor parallelism each ``tp`` rank runs its slice
   of every local expert on the same rows and the outputs are summed over ``tp`` before they
   travel back (plain exchange).
4. *Combine.* Each token's ``K`` expert rows are summed with their weights in fp32.
   With ``score_apply="pre"`` (Llama-4 style) each dispatched row is instead multiplied by its
   routing weight (in fp32, cast back to the row dtype) before the expert GEMMs, and the
   combine sums the rows unweighted; the gated MLP does not commute with the weight, so the
   two modes give different outputs.
5. *Shared experts* (Qwen2/3.5-MoE, DeepSeek-V3) run on every token and are added, scaled by
   the sigmoid of their gate where the model has one.

Every child other than the experts (router, shared experts and their gate) is the original
module object under its original name, so their parameter names, the optimizer's references to
them and any hooks transformers installed on them are unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from deepshard.autoep._combine import CombineImpl, combine, sort_by_expert
from deepshard.autoep._dispatch import AllToAllTransport, local_expert_order
from deepshard.autoep._grouped_experts import GroupedExperts
from deepshard.autoep._overlap import overlapped_exchange
from deepshard.autoep._presets import RouterSettings
from deepshard.autoep._router import Routing, route
from deepshard.comm import Group, copy_to_group, reduce_from_group

__all__ = ["ExpertParallelBlock", "run_by_source"]


class ExpertParallelBlock(nn.Module):
    """A MoE block whose ``E`` experts are spread over the ``ep`` ranks of a group.

    Args:
        router: The original router module; its output (or output ``[0]``) is the logits.
        router_name: Its attribute name in the original block.
        experts: This rank's experts, ``[lo, hi)`` of the global ids.
        experts_name: The attribute name of the original experts container.
        num_experts: ``E``, the global expert count.
        settings: The routing knobs.
        transport: The token exchange over the ``ep`` group.
        correction_bias_path: Dotted path, relative to this block, of the score-correction
            bias, or None.
        shared: ``(name, module)`` of the shared experts, or None.
        shared_gate: ``(name, module)`` of the shared experts' gate, or None.
        combine_impl: How the routed rows are summed back into tokens (`combine`).
        score_apply: ``"post"``: weights scale the expert outputs at the combine; ``"pre"``:
            they scale the dispatched input rows and the combine is an unweighted sum.
        tp_group: Under expert tensor parallelism, the ``tp`` group the local experts are
            split over: the received rows enter through `copy_to_group`, the expert outputs
            are summed over it (`reduce_from_group`) before they travel back. None: whole.
    """

    def __init__(
        self,
        *,
        router: nn.Module,
        router_name: str,
        experts: GroupedExperts,
        experts_name: str,
        num_experts: int,
        settings: RouterSettings,
        transport: AllToAllTransport,
        correction_bias_path: str | None = None,
        shared: tuple[str, nn.Module] | None = None,
        shared_gate: tuple[str, nn.Module] | None = None,
        combine_impl: CombineImpl = "weighted_sum",
        score_apply: Literal["pre", "post"] = "post",
        tp_group: Group | None = None,
    ) -> None:
        super().__init__()
        self.add_module(router_name, router)
        self.add_module(experts_name, experts)
        self._router_name, self._experts_name = router_name, experts_name
        self._shared_name = shared[0] if shared else None
        self._shared_gate_name = shared_gate[0] if shared_gate else None
        for child in (shared, shared_gate):
            if child is not None:
                self.add_module(*child)
        self.num_experts = num_experts
        self.settings = settings
        self.transport = transport
        self.correction_bias_path = correction_bias_path
        self.combine_impl: CombineImpl = combine_impl
        self.score_apply: Literal["pre", "post"] = score_apply
        self.tp_group = tp_group
        self.overlap_exchange = True
        """Overlap the own rows' experts with the exchange (`_overlap`); False: plain."""

    @property
    def local_experts(self) -> GroupedExperts:
        """This rank's experts."""
        experts = getattr(self, self._experts_name)
        assert isinstance(experts, GroupedExperts)
        return experts

    def _correction_bias(self) -> torch.Tensor | None:
        if self.correction_bias_path is None:
            return None
        owner_path, _, leaf = self.correction_bias_path.rpartition(".")
        owner = self.get_submodule(owner_path) if owner_path else self
        bias = getattr(owner, leaf)
        assert isinstance(bias, torch.Tensor)
        return bias

    def _route(self, x: torch.Tensor) -> Routing:
        out = getattr(self, self._router_name)(x)
        logits = out[0] if isinstance(out, tuple) else out
        s = self.settings
        return route(
            logits,
            top_k=s.top_k,
            score_func=s.score_func,
            correction_bias=self._correction_bias(),
            route_norm=s.route_norm,
            route_scale=s.route_scale,
            num_groups=s.num_groups,
            limited_groups=s.limited_groups,
            group_score=s.group_score,
        )

    def routed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The weighted sum of each token's routed experts, ``[T, H]`` (steps 3-4)."""
        order = sort_by_expert(routing.expert_ids, self.num_experts)
        rows = x.index_select(0, order.token_of_row)
        weights = routing.weights
        if self.score_apply == "pre":
            flat = weights.reshape(-1)
            row_weights = flat.new_zeros(flat.shape).index_copy(0, order.index.reshape(-1), flat)
            rows = (rows.float() * row_weights.unsqueeze(-1)).to(rows.dtype)
            weights = torch.ones_like(weights)
        overlapping = self._overlapping_transport()
        if overlapping is not None:
            table = overlapping.exchange_counts(order.counts)
            back = overlapped_exchange(
                rows, order.counts, table, group=overlapping.process_group, run=self._run_experts
            )
        else:
            transport = self.transport
            received, received_counts, plan = transport.dispatch(rows, order.counts)
            if self.tp_group is not None:  # each tp rank computes its slice of every expert
                received = copy_to_group(received, group=self.tp_group)
            out = self._run_experts(received, received_counts)
            if self.tp_group is not None:  # partial sums over the experts' tp slices
                out = reduce_from_group(out, group=self.tp_group)
            back = transport.combine(out, plan)
        return combine(back, weights, order.index, impl=self.combine_impl)

    def _overlapping_transport(self) -> AllToAllTransport | None:
        """The transport when the exchange overlaps the own rows' experts
        (`overlapped_exchange`), else None (the plain exchange)."""
        transport = self.transport
        if (
            self.overlap_exchange
            and isinstance(transport, AllToAllTransport)
            and transport.ep_size > 1
            and self.tp_group is None
            and not torch.compiler.is_compiling()
        ):
            return transport
        return None

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return run_by_source(self.local_experts, rows, counts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., H] -> [..., H]``, as the replaced block."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        out = self.routed(x, self._route(x))
        if self._shared_name is not None:
            shared = getattr(self, self._shared_name)(x)
            if self._shared_gate_name is not None:
                shared = torch.sigmoid(getattr(self, self._shared_gate_name)(x)) * shared
            out = out + shared
        return out.reshape(shape)


def run_by_source(
    experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Rows laid out as (source, local expert) blocks through ``experts``, outputs in that order.

    Args:
        experts: This rank's experts (called as a module, so module hooks run).
        rows: ``[M, H]``, ``counts[s, e]`` rows from source ``s`` for local expert ``e``,
            source-major.
        counts: ``[sources, E_local]`` int64.
    """
    if counts.shape[0] == 1:  # one source: already expert-contiguous
        out: torch.Tensor = experts(rows, counts[0])
        return out
    if experts.uses_grouped_mm(rows):
        local = local_expert_order(counts)
        out = experts(rows.index_select(0, local.order), local.group_sizes)
        return out.index_select(0, local.inverse)
    # The loop reads each (source, expert) block in place: no regrouping gathers.
    return experts.forward_by_source(rows, counts)
