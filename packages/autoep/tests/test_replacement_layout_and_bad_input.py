"""What `parallelize_experts` keeps on a rank, in one process (fake process group, no data moved).

Rank 1 of EP = 2 must hold exactly the second half of every stacked expert tensor, 16-byte
aligned, with placements ``Shard(0)`` on ``ep`` reduced over ``dp`` and dense ones reduced over
``dp × ep × sp``; module-list experts are stacked into the same layout (and at EP = 1, where no
collective runs, give the fused model's logits); the correction bias keeps its kind, wherever
it lives; DeepSeek-V2's ``topk_method`` is read; and bad input is refused with a
`ConfigError` naming the key.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from deepshard.autoep import parallelize_experts, route
from deepshard.interface import Replicate, Shard, Topology
from deepshard.interface.config.moe import ExpertParallelConfig
from deepshard.interface.errors import ConfigError
from deepshard.testing import fake_mesh, import_beside

pytest.importorskip("transformers", reason="transformers is in the dev group only")
_tiny = import_beside(__file__, "_tiny_moe.py")


class _Mlp(nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: Any) -> None:
        super().__init__()
        inter = down.shape[1]
        self.gate_proj = nn.Linear(gate_up.shape[1], inter, bias=False)
        self.up_proj = nn.Linear(gate_up.shape[1], inter, bias=False)
        self.down_proj = nn.Linear(inter, down.shape[0], bias=False)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate_up[:inter])
            self.up_proj.weight.copy_(gate_up[inter:])
            self.down_proj.weight.copy_(down)
        self.act_fn = act


def _as_module_list(model: nn.Module) -> nn.Module:
    """The same model with every fused experts container rewritten as a ModuleList of MLPs."""
    out = copy.deepcopy(model)
    for module in out.modules():
        experts = getattr(module, "experts", None)
        if experts is not None and hasattr(experts, "gate_up_proj"):
            mlps = [
                _Mlp(
                    experts.gate_up_proj[e].detach(), experts.down_proj[e].detach(), experts.act_fn
                )
                for e in range(experts.gate_up_proj.shape[0])
            ]
            module.experts = nn.ModuleList(mlps)
    return out


def test_rank_1_of_ep2_keeps_the_second_half_of_each_expert_stack() -> None:
    ref = _tiny.build("mixtral", 4)
    model = copy.deepcopy(ref)
    with fake_mesh(Topology(ep=2), 1) as mesh:
        report = parallelize_experts(model, mesh)
    params = dict(model.named_parameters())
    assert len(report.blocks) == 2 and report.blocks[0].local_experts == (2, 4)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert torch.equal(params[name], ref.get_parameter(name)[2:4]), name
        assert params[name].data_ptr() % 16 == 0 and params[name].is_contiguous()
        placement = report.placements[name]
        assert placement.placement("ep") == Shard(0) and placement.reduce_over == ("dp",)
        assert placement.global_shape == tuple(ref.get_parameter(name).shape)
        pieces = report.shard_maps[name].pieces
        assert [(p.rank, p.box_offset[0], p.box_shape[0]) for p in pieces] == [(0, 0, 2), (1, 2, 2)]
    router = report.placements["model.layers.0.mlp.gate.weight"]
    assert router.reduce_over == ("dp", "ep", "sp") and router.placement("ep") == Replicate()
    assert set(report.placements) == set(params)


def test_module_list_experts_are_stacked_and_give_the_fused_logits() -> None:
    ref = _tiny.build("qwen3_moe", 4)
    listed = _as_module_list(ref)
    with fake_mesh(Topology(ep=2), 0) as mesh:
        sharded = parallelize_experts(copy.deepcopy(listed), mesh)
    assert sharded.blocks[0].layout == "module_list" and sharded.blocks[0].local_experts == (0, 2)
    with fake_mesh(Topology(), 0) as mesh:
        report = parallelize_experts(listed, mesh)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(listed.get_parameter(name), ref.get_parameter(name))
    assert len(report.swaps[0].sources) == 8  # gate and up of 4 experts
    ids = _tiny.batch(0, 0)
    with torch.no_grad():
        torch.testing.assert_close(listed(input_ids=ids).logits, ref(input_ids=ids).logits)


def _deepseek_with_bias_on_block(kind: str) -> nn.Module:
    """A DeepSeek-V3 model whose correction bias lives on the block instead of the gate."""
    model = _tiny.build("deepseek_v3", 8)
    block = model.model.layers[1].mlp
    bias = block.gate.e_score_correction_bias
    del block.gate._buffers["e_score_correction_bias"]
    if kind == "parameter":
        block.e_score_correction_bias = nn.Parameter(bias.clone(), requires_grad=False)
    else:
        block.register_buffer("e_score_correction_bias", bias.clone(), persistent=False)
    return model


@pytest.mark.parametrize("kind", ["parameter", "buffer"])
def test_bias_on_the_block_keeps_its_kind_and_values(kind: str) -> None:
    model = _deepseek_with_bias_on_block(kind)
    before = model.model.layers[1].mlp.e_score_correction_bias
    with fake_mesh(Topology(ep=2), 0) as mesh:
        report = parallelize_experts(model, mesh)
    block = model.model.layers[1].mlp
    assert block.e_score_correction_bias is before
    assert report.blocks[0].correction_bias == "model.layers.1.mlp.e_score_correction_bias"
    if kind == "parameter":
        assert isinstance(block.e_score_correction_bias, nn.Parameter)
        assert not block.e_score_correction_bias.requires_grad
    else:
        assert "e_score_correction_bias" in block._buffers
        assert "e_score_correction_bias" in block._non_persistent_buffers_set


def test_two_bias_candidates_are_refused() -> None:
    model = _tiny.build("deepseek_v3", 8)
    block = model.model.layers[1].mlp
    block.register_buffer("e_score_correction_bias", torch.zeros(8))
    with fake_mesh(Topology(ep=2), 0) as mesh, pytest.raises(ConfigError, match="2 score-corr"):
        parallelize_experts(model, mesh)


def test_bad_input_names_the_key() -> None:
    with fake_mesh(Topology(ep=2), 0) as mesh:
        with pytest.raises(ConfigError, match="autoep_size: 4 differs"):
            parallelize_experts(
                _tiny.build("mixtral", 4), mesh, ExpertParallelConfig(enabled=True, autoep_size=4)
            )
        with pytest.raises(ConfigError, match="no MoE block"):
            parallelize_experts(nn.Sequential(nn.Linear(4, 4)), mesh)
        with pytest.raises(ConfigError, match="preset_model: 'gpt'"):
            parallelize_experts(
                _tiny.build("mixtral", 4), mesh, ExpertParallelConfig(preset_model="gpt")
            )
    message = "autoep_size: 4 does not divide the 6 experts"
    with fake_mesh(Topology(ep=4), 0) as mesh, pytest.raises(ConfigError, match=message):
        parallelize_experts(_tiny.build("mixtral", 6), mesh)


def test_deepseek_v2_topk_method_is_read_and_an_unknown_one_refused() -> None:
    greedy = _tiny.build("deepseek_v2", 8)
    greedy.model.layers[1].mlp.gate.topk_method = "greedy"
    unknown = _tiny.build("deepseek_v2", 8)
    unknown.model.layers[1].mlp.gate.topk_method = "noaux_tc"
    with fake_mesh(Topology(ep=2), 0) as mesh:
        parallelize_experts(greedy, mesh)
        with pytest.raises(ConfigError, match="topk_method 'noaux_tc'"):
            parallelize_experts(unknown, mesh)
    settings = greedy.model.layers[1].mlp.settings
    assert settings.num_groups is None and settings.group_score == "max"  # greedy: no groups
    with pytest.raises(ConfigError, match="group_score 'sum'"):
        route(torch.zeros(2, 8), top_k=2, score_func="softmax", route_norm=False,
              route_scale=1.0, num_groups=2, limited_groups=1, group_score="sum")  # type: ignore[arg-type]  # fmt: skip
