"""Moving an optimizer built before expert parallelism onto the replaced parameters.

A user may build the optimizer first (DeepSpeed's #8377: AutoEP then kept training the
discarded full expert tensors). `remap_optimizer` edits the optimizer in place, per `ParamSwap`:

* the sources (old expert tensors) leave their param group and the new parameter joins that
  group, so its learning rate, weight decay... are the ones the user chose for the sources;
  sources spread over several groups are refused (no group would be right);
* state (Adam's moments, step) kept for the sources is carried over: every tensor of source
  shape goes through the swap's ``derive`` (the same slicing/stacking that built the new
  parameter), other values (``step``) are copied from the first source; the sources' state is
  deleted either way, so nothing stale remains;
* a swap none of whose sources is in the optimizer adds nothing (the user did not train them).
"""

from __future__ import annotations

from typing import Any

import torch

from deepshard.autoep._report import ParamSwap, ReplacementReport
from deepshard.interface.errors import ConfigError

__all__ = ["remap_optimizer"]


def _group_of(optimizer: torch.optim.Optimizer, swap: ParamSwap) -> int | None:
    ids = {id(p) for p in swap.sources}
    groups = {
        i for i, g in enumerate(optimizer.param_groups) if any(id(p) in ids for p in g["params"])
    }
    if len(groups) > 1:
        raise ConfigError(
            f"optimizer: the parameters {swap.name} is built from are in param groups "
            f"{sorted(groups)}; put all experts of one block in one group (or build the "
            "optimizer after parallelize_experts)"
        )
    return groups.pop() if groups else None


def _derived_state(swap: ParamSwap, states: list[dict[str, Any]]) -> dict[str, Any]:
    first = states[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        shaped = all(
            isinstance(s.get(key), torch.Tensor) and s[key].shape == src.shape
            for s, src in zip(states, swap.sources, strict=True)
        )
        if shaped and isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = swap.derive([s[key] for s in states]).clone()
        else:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def remap_optimizer(optimizer: torch.optim.Optimizer, report: ReplacementReport) -> None:
    """Points ``optimizer`` at the parameters `parallelize_experts` created (in place).

    Args:
        optimizer: Any ``torch.optim.Optimizer`` built on the unreplaced model.
        report: What `parallelize_experts` returned.

    Raises:
        ConfigError: One swap's sources sit in different param groups.
    """
    for swap in report.swaps:
        index = _group_of(optimizer, swap)
        if index is None:
            continue
        ids = {id(p) for p in swap.sources}
        group = optimizer.param_groups[index]
        group["params"] = [p for p in group["params"] if id(p) not in ids]
        group["params"].append(swap.new)
        states = [optimizer.state.get(p) for p in swap.sources]
        for p in swap.sources:
            optimizer.state.pop(p, None)
        if all(states):
            optimizer.state[swap.new] = _derived_state(swap, [s for s in states if s])
