"""Invariants a caller can break raise ValueError with a message (never a bare ``assert``).

An ``assert`` vanishes under ``python -O`` and says nothing a user can act on; these checks
guard arguments that come from a config or a direct call.
"""

from __future__ import annotations

import pytest
import torch

from deepshard.zero._flat_params import FlatParams
from deepshard.zero._full_grads import TransformBuffers
from deepshard.zero._offload_plan import plan_sub_groups
from deepshard.zero.layout import plan_flat_layout


def test_a_zero_sub_group_size_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"zero_optimization.sub_group_size must be >= 1"):
        plan_sub_groups([(0, 0, 10, 0), (1, 0, 4, 1)], 0)
    # 10 elements -> 4 + 4 + 2, 4 elements -> 4
    assert len(plan_sub_groups([(0, 0, 10, 0), (1, 0, 4, 1)], 4)) == 3 + 1


def test_copy_from_a_partitioned_layout_says_what_to_use() -> None:
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
    layout = plan_flat_layout([(4,), (3,)], element_size=4, world_size=2, bucket_numel=8)
    flat = FlatParams(params, layout, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="partitioned over 2 ranks; use gather_from"):
        flat.copy_from(torch.zeros(layout.numel))


def test_transformed_parameters_without_a_transform_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\['w'\] are to be transformed but the transform"):
        TransformBuffers(None, {"w": (2, 2)}, "load a checkpoint saved with Muon")
    assert TransformBuffers(None, {}, "").buffers == {}
