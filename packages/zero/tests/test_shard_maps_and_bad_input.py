"""In one process, playing rank 3 of 4 on a fake process group (construction needs no collective):
the shard maps a real `ZeroOptimizer` emits match its master partition value for value, and bad
input is refused with an error naming the config key and the fix."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from deepshard.interface import DeepShardConfig, Topology
from deepshard.interface.config import ZeroConfig
from deepshard.interface.errors import CommError, ConfigError
from deepshard.testing import fake_mesh
from deepshard.zero import ZERO_SAFE_ATTRIBUTE, ZeroOptimizer, build_zero_optimizer, torch_dtype

WORLD, RANK = 4, 3


@pytest.fixture
def group() -> Iterator[Any]:
    with fake_mesh(Topology(dp=WORLD), RANK) as mesh:
        yield mesh["dp"]


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(13, 37), torch.nn.Linear(37, 29), torch.nn.Linear(29, 7)
    ).to(dtype)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() == 1]
    return torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}])


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shard_maps_locate_every_element_of_the_masters(
    group: Any, stage: int, dtype: torch.dtype
) -> None:
    model = _model(dtype)
    original = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    zero = ZeroOptimizer(
        _adamw(model),
        group=group,
        config=ZeroConfig(stage=stage, reduce_bucket_size=700),
        named_parameters=model.named_parameters(),
    )
    shards = zero.shard_maps()
    assert sorted(s.name for s in shards) == sorted(original)
    for shard in shards:
        shard_map = shard.shard_map
        assert shard_map.missing_elements() == 0
        assert shard_map.global_shape == tuple(original[shard.name].shape)
        assert shard_map.dtype == "float32" and shard_map.axes == ("dp",)
        master = zero.master_partitions[shard.group_index]
        flat = original[shard.name].reshape(-1)
        for piece in shard_map.pieces_of(RANK):
            local = master[piece.local_offset : piece.local_offset + piece.numel]
            assert torch.equal(local, flat[piece.flat_start : piece.stop])
        ranks = {piece.rank for piece in shard_map.pieces}
        if stage == 0:  # replicated
            assert ranks == set(range(WORLD))
    # parameters now live in the flat buffers but keep their values, names and hooks
    for name, param in model.named_parameters():
        assert torch.equal(param.detach().float(), original[name])
    # each param group's inner "params" is this rank's master partition
    for group_dict, master in zip(zero.param_groups, zero.master_partitions, strict=True):
        assert group_dict["params"] == [master] and master.dtype == torch.float32
    assert zero.param_groups[1]["weight_decay"] == 0.0


class _Custom(torch.optim.SGD):
    """An SGD subclass: not in the tested list by its exact type."""


class _MarkedSafe(torch.optim.SGD):
    zero_safe = True


def test_untested_optimizer_needs_the_flag(group: Any) -> None:
    model = _model()
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer") as info:
        ZeroOptimizer(_Custom(model.parameters(), lr=0.1), group=group)
    assert info.value.problems[0][0] == "zero_allow_untested_optimizer"
    ZeroOptimizer(
        _Custom(_model().parameters(), lr=0.1), group=group, zero_allow_untested_optimizer=True
    )
    assert getattr(_MarkedSafe, ZERO_SAFE_ATTRIBUTE) is True
    ZeroOptimizer(_MarkedSafe(_model().parameters(), lr=0.1), group=group)


def test_compute_grad_norm_false_needs_clipping_off(group: Any) -> None:
    config = DeepShardConfig.from_dict(
        {"zero_optimization": {"stage": 2, "compute_grad_norm": False}}
    )
    with pytest.raises(ConfigError, match=r"zero_optimization\.compute_grad_norm"):
        build_zero_optimizer(_adamw(_model()), config, group=group)
    config = DeepShardConfig.from_dict(
        {"zero_optimization": {"stage": 2, "compute_grad_norm": False}, "gradient_clipping": 0}
    )
    zero = build_zero_optimizer(_adamw(_model()), config, group=group)
    assert zero.gradient_clipping == 0.0


def test_build_reads_the_deepspeed_keys(group: Any) -> None:
    config = DeepShardConfig.from_dict(
        {
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000},
            "gradient_clipping": 0.5,
            "gradient_allreduce_op": "sum",
            "prescale_gradients": True,
            "gradient_predivide_factor": 4.0,
            "communication_data_type": "bfloat16",
            "data_types": {"grad_accum_dtype": "fp32"},
        }
    )
    zero = build_zero_optimizer(_adamw(_model(torch.bfloat16)), config, group=group)
    assert (zero.stage, zero.partition_count, zero.partition_rank) == (1, WORLD, RANK)
    assert zero.gradient_clipping == 0.5
    r = zero.reduction
    assert (r.op, r.prescale, r.predivide_factor, r.dtype) == ("sum", True, 4.0, torch.bfloat16)
    # stage 1 accumulates locally in grad_accum_dtype: a full fp32 buffer
    numel = sum(layout.numel for layout in zero.layouts)
    assert zero.gradient_bytes() == 4 * numel


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"stage": 3}, "zero_optimization.stage"),
        (
            {"stage": 0, "offload_optimizer": {"device": "cpu"}},
            "zero_optimization.offload_optimizer",
        ),
        ({"allgather_partitions": False}, "zero_optimization.allgather_partitions"),
    ],
)
def test_unsupported_settings_name_their_key(
    group: Any, settings: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError, match=key):
        ZeroOptimizer(_adamw(_model()), group=group, config=ZeroConfig(**{"stage": 1, **settings}))


def test_bad_optimizers_and_models(group: Any) -> None:
    stepped = _model()
    optimizer = torch.optim.SGD(stepped.parameters(), lr=0.1, momentum=0.9)
    stepped(torch.ones(2, 13)).sum().backward()
    optimizer.step()
    with pytest.raises(ConfigError, match="already has state"):
        ZeroOptimizer(optimizer, group=group)
    mixed = _model()
    mixed[1].to(torch.bfloat16)
    with pytest.raises(ConfigError, match="mixes dtypes"):
        ZeroOptimizer(torch.optim.AdamW(mixed.parameters()), group=group)
    shared = _model()
    twice = _adamw(shared)  # torch refuses duplicates at construction, not later edits
    twice.param_groups[1]["params"].append(shared[0].weight)
    with pytest.raises(ConfigError, match="twice"):
        ZeroOptimizer(twice, group=group)
    with pytest.raises(ConfigError, match=r"ZeRO wraps a torch\.optim\.Optimizer"):
        ZeroOptimizer(object(), group=group)  # type: ignore[arg-type]


def test_step_before_a_boundary_backward_is_refused(group: Any) -> None:
    zero = ZeroOptimizer(_adamw(_model()), group=group)
    with pytest.raises(CommError, match="is_boundary=True"):
        zero.step()
    with pytest.raises(ConfigError, match="closure"):
        zero.step(lambda: 0.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="param groups"):
        zero.add_param_group({"params": []})


def test_every_refusal_is_listed_before_anything_is_built(group: Any) -> None:
    model = _model()
    untested = torch.optim.RMSprop(model.parameters(), lr=0.1)
    config = ZeroConfig(stage=3, allgather_partitions=False)
    with pytest.raises(ConfigError) as caught:
        ZeroOptimizer(untested, group=group, config=config, gradient_clipping=-1.0)
    keys = [key for key, _ in caught.value.problems]
    assert keys == [
        "zero_optimization.stage",
        "gradient_clipping",
        "zero_optimization.allgather_partitions",
        "zero_allow_untested_optimizer",
    ]
    assert str(caught.value).startswith("4 problems in the DeepShard config")
    # refused before the parameters were flattened or hooked
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_one_dtype_name_map() -> None:
    assert [torch_dtype(n, key="k") for n in ("fp32", "fp16", "bf16", None)] == [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        None,
    ]
    with pytest.raises(ConfigError, match=r"data_types\.grad_accum_dtype: must be one of"):
        torch_dtype("fp8", key="data_types.grad_accum_dtype")
