"""`tensor_parallel.partition_config` layer specs: nested sub-parameter shapes, strict mode,
and the shape mistakes refused with the spec's key path (no torch: data only)."""

from __future__ import annotations

import pytest

from deepshard.interface import ConfigError, DeepShardConfig


def _tp(partition: dict[str, object]) -> DeepShardConfig:
    raw = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"partition_config": partition}}
    return DeepShardConfig.from_dict(raw)


def test_nested_and_equal_sub_parameter_shapes_are_kept() -> None:
    config = _tp({
        "strict_mode": True,
        "lm_head_patterns": ["output_layer"],
        "layer_specs": [
            {"patterns": ["qkv"], "shape": [[64, 16, 16], -1], "partition_dim": 0},
            {"patterns": ["down"], "partition_type": "ROW"},
        ],
    })  # fmt: skip
    partition = config.tensor_parallel.partition_config
    assert partition is not None and partition.strict_mode
    assert partition.lm_head_patterns == ["output_layer"]
    qkv, down = partition.layer_specs
    assert qkv.shape == [[64, 16, 16], -1] and qkv.split_dim == 0
    assert down.partition_type == "row" and down.split_dim == 1
    default = _tp({}).tensor_parallel.partition_config
    assert default is not None and not default.strict_mode
    assert default.lm_head_patterns == ["lm_head", "embed_out"]


@pytest.mark.parametrize(
    ("spec", "key", "words"),
    [
        ({"shape": [-1, [4, 4]]}, "shape", "belongs at the split dimension 0"),
        ({"shape": [[4, 0], -1]}, "shape", "must be positive"),
        ({"shape": [2, -2]}, "shape", "dimension 1 is -2"),
        ({"shape": [2, -1], "partition_dim": 2}, "partition_dim", "out of range"),
        ({"partition_dim": -1}, "partition_dim", "must be >= 0"),
    ],
)
def test_shape_mistakes_name_the_spec_key(spec: dict[str, object], key: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as caught:
        _tp({"layer_specs": [{"patterns": ["x"], **spec}]})
    path = f"tensor_parallel.partition_config.layer_specs[0].{key}"
    assert [problem for problem, _ in caught.value.problems] == [path]
