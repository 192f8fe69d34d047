"""In one process, playing rank 3 of 4 on a fake process group: how the inner optimizer sees the
master partitions of Muon's matrices (`deepshard.interface.ParamShapes`), and the errors for a
full-gradient transform used wrongly."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from deepshard.interface import ParamShapes, Topology
from deepshard.interface.config import ZeroConfig
from deepshard.interface.errors import CheckpointError, ConfigError
from deepshard.optimizers import Muon
from deepshard.testing import fake_mesh, import_beside
from deepshard.zero import ZeroOptimizer

_muon = import_beside(__file__, "_muon_training.py")
WORLD, RANK = 4, 3


@pytest.fixture
def group() -> Iterator[Any]:
    with fake_mesh(Topology(dp=WORLD), RANK) as mesh:
        yield mesh["dp"]


@pytest.mark.parametrize("stage", [1, 2])
def test_master_views_of_muon_matrices_report_their_shapes(group: Any, stage: int) -> None:
    model = _muon._training.make_model()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    zero = _muon.wrap(model, group, stage=stage, reduce_bucket_size=2000)
    as_protocol: object = zero
    assert isinstance(as_protocol, ParamShapes)
    pieces = {  # this rank's piece of every matrix, from the shard maps
        s.name: [p for p in s.shard_map.pieces if p.rank == RANK] for s in zero.shard_maps()
    }
    [muon_group] = [g for g in zero.param_groups if g["use_muon"]]
    [adam_group] = [g for g in zero.param_groups if not g["use_muon"]]
    held = {n: ps for n, ps in pieces.items() if ps and len(shapes[n]) == 2}
    assert held, "rank 3 of 4 holds a piece of some matrix"
    assert len(muon_group["params"]) == len(held)
    for view, name in zip(muon_group["params"], sorted(held, key=list(shapes).index), strict=True):
        [piece] = held[name]
        assert view.ndim == 1 and view.numel() == piece.flat_stop - piece.flat_start
        assert zero.full_shape(view) == shapes[name]
        master = zero.master_partitions[0]
        assert view.data_ptr() == master[piece.local_offset :].data_ptr()  # a view, no copy
    assert [zero.full_shape(p) for p in adam_group["params"]] == [None]
    assert zero.full_shape(next(model.parameters())) is None
    # Muon itself accepts the views as matrices only through ZeRO's ParamShapes
    Muon([{"params": muon_group["params"], "use_muon": True}], param_shapes=zero)
    with pytest.raises(ConfigError, match="use_muon=True group holds parameters of shapes"):
        Muon([{"params": muon_group["params"], "use_muon": True}])


def test_stage0_hands_whole_matrices_as_views(group: Any) -> None:
    model = _muon._training.make_model()
    zero = _muon.wrap(model, group, stage=0)
    [muon_group] = [g for g in zero.param_groups if g["use_muon"]]
    matrices = [p for p in model.parameters() if p.dim() == 2]
    assert [zero.full_shape(v) for v in muon_group["params"]] == [m.shape for m in matrices]
    assert [v.numel() for v in muon_group["params"]] == [m.numel() for m in matrices]


def test_muon_without_a_transform_is_refused_as_not_element_wise(group: Any) -> None:
    model = _muon._training.make_model()
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer"):
        ZeroOptimizer(_muon.make_muon(model), group=group, config=ZeroConfig(stage=1))


def test_transformed_params_must_be_whole_groups_with_a_transform(group: Any) -> None:
    model = _muon._training.make_model()
    weights = [p for p in model.parameters() if p.dim() == 2]

    def build(**kwargs: Any) -> None:
        inner = torch.optim.AdamW(list(model.parameters()))
        ZeroOptimizer(inner, group=group, config=ZeroConfig(stage=1), **kwargs)

    with pytest.raises(ConfigError, match="without a full_grad_transform"):
        build(transformed_params=weights)
    with pytest.raises(ConfigError, match="param group 0 has 3 of its 6"):
        build(full_grad_transform=_muon.muon_transform, transformed_params=weights)
    stranger = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ConfigError, match="1 transformed_params are in none"):
        build(full_grad_transform=_muon.muon_transform, transformed_params=[stranger])


def _flat_transform(grad: torch.Tensor, buffer: torch.Tensor, group: Mapping[str, Any]) -> Any:
    return grad.reshape(-1)


def test_a_transform_returning_another_shape_is_refused(group: Any) -> None:
    model = _muon._training.make_model()
    muon = _muon.make_muon(model)
    zero = ZeroOptimizer(
        muon,
        group=group,
        config=ZeroConfig(stage=0),
        named_parameters=model.named_parameters(),
        full_grad_transform=_flat_transform,
        transformed_params=_muon.muon_params(muon),
    )
    x, y = _muon._training.batch(0)
    zero.backward(_muon._training.loss_fn(model, x, y))
    with pytest.raises(ConfigError, match=r"returned shape \(481,\) for parameter '0.weight'"):
        zero.step()


def test_buffers_of_unknown_parameters_are_refused_on_load(group: Any) -> None:
    model = _muon._training.make_model()
    zero = _muon.wrap(model, group, stage=1)
    state = zero.state_dict()
    state["full_grad_buffers"] = {"nope.weight": torch.zeros(2, 2)}
    with pytest.raises(CheckpointError, match=r"'nope\.weight'"):
        zero.load_state_dict(state)
