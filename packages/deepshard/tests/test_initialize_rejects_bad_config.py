"""``initialize`` refuses bad or unsupported input with a ConfigError naming the key.

The cases that need a world run inside one ``run_on_mesh`` call on 2 ranks; each returns the
error's type and the key paths it names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

_ADAM = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}


def _ltd(**section: Any) -> dict[str, Any]:
    return {"data_efficiency": {"data_routing": {"random_ltd": section}}}


_BATCH = {"train_batch_size": 4}

CASES: dict[str, tuple[dict[str, Any], str]] = {
    "batch sizes disagree with the world of 2": (
        {
            "train_batch_size": 6,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": _ADAM,
        },
        "train_batch_size",
    ),
    "global batch not divisible by the world": (
        {"train_batch_size": 5, "optimizer": _ADAM},
        "train_batch_size",
    ),
    "unknown optimizer": ({**_BATCH, "optimizer": {"type": "Adamm"}}, "optimizer.type"),
    "unknown optimizer parameter": (
        {**_BATCH, "optimizer": {"type": "AdamW", "params": {"learning_rate": 1e-3}}},
        "optimizer.params.learning_rate",
    ),
    "no gradient norm but clipping": (
        {
            **_BATCH,
            "optimizer": _ADAM,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 1, "compute_grad_norm": False},
        },
        "zero_optimization.compute_grad_norm",
    ),
    "no gradient norm at stage 0": (
        {
            **_BATCH,
            "optimizer": _ADAM,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 0, "compute_grad_norm": False},
        },
        "zero_optimization.compute_grad_norm",
    ),
    "Muon with NVMe optimizer offload at stage 3": (
        {
            **_BATCH,
            "optimizer": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 1e-2}},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
            },
        },
        "zero_optimization.offload_optimizer.device",
    ),
    "Muon with optimizer offload below stage 3": (
        {
            **_BATCH,
            "optimizer": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 1e-2}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        },
        "zero_optimization.offload_optimizer",
    ),
    "optimizer offload at stage 0": (
        {
            **_BATCH,
            "optimizer": _ADAM,
            "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}},
        },
        "zero_optimization.offload_optimizer",
    ),
    "optimizer offload in an old config's spelling": (
        {**_BATCH, "optimizer": _ADAM, "zero_optimization": {"stage": 0, "cpu_offload": True}},
        "zero_optimization.offload_optimizer",
    ),
    "autocast with bf16": (
        {
            **_BATCH,
            "optimizer": _ADAM,
            "bf16": {"enabled": True},
            "torch_autocast": {"enabled": True},
        },
        "torch_autocast.enabled",
    ),
    "untested client optimizer": ({**_BATCH}, "zero_allow_untested_optimizer"),
    "schedule without optimizer": (
        {**_BATCH, "scheduler": {"type": "WarmupLR", "params": {}}},
        "scheduler",
    ),
}


def _try(mesh: Any, name: str, config: dict[str, Any]) -> tuple[str, list[str]] | None:
    import deepshard.engine as ds

    model = torch.nn.Linear(3, 2)
    optimizer = None
    if name == "untested client optimizer":
        optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    try:
        ds.initialize(model, config, optimizer=optimizer, mesh=mesh)
    except ds.DeepShardError as error:
        keys = [key for key, _ in getattr(error, "problems", [])]
        return type(error).__name__, keys
    return None


def _all_cases(mesh: Any) -> dict[str, Any]:
    import deepshard.engine as ds

    found: dict[str, Any] = {name: _try(mesh, name, config) for name, (config, _) in CASES.items()}
    # A refused optimizer is refused before ZeRO shards the model: the parameters keep their
    # own storage (sharding re-points them into a unit's flat buffer).
    model = torch.nn.Linear(3, 2)
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ds.ConfigError, match="zero_allow_untested_optimizer"):
        ds.initialize(
            model, {**_BATCH}, optimizer=torch.optim.RMSprop(model.parameters()), mesh=mesh
        )
    found["storage kept"] = before == [p.data_ptr() for p in model.parameters()]
    # The same untested optimizer is accepted once the config allows it.
    model = torch.nn.Linear(3, 2)
    allowed = {**_BATCH, "zero_allow_untested_optimizer": True}
    ds.initialize(model, allowed, optimizer=torch.optim.RMSprop(model.parameters()), mesh=mesh)
    # An old config's offload switches that are off offload nothing: it runs.
    legacy = {"stage": 2, "cpu_offload": False, "cpu_offload_param": False}
    ds.initialize(model, {**_BATCH, "optimizer": _ADAM, "zero_optimization": legacy}, mesh=mesh)
    return found


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ranks = run_on_mesh(_all_cases, 2, store_dir=tmp_path_factory.mktemp("bad"), timeout_s=120)
    assert ranks[0] == ranks[1]
    return ranks[0]


def test_a_refused_optimizer_leaves_the_model_unsharded(results: dict[str, Any]) -> None:
    assert results["storage kept"] is True


@pytest.mark.parametrize("name", list(CASES))
def test_each_bad_config_is_a_config_error_naming_the_key(
    results: dict[str, Any], name: str
) -> None:
    _, key = CASES[name]
    assert results[name] is not None, f"{name}: initialize accepted it"
    error_type, keys = results[name]
    assert error_type == "ConfigError"
    assert key in keys, f"{name}: the error names {keys}, not {key}"


@pytest.mark.parametrize(
    ("config", "key"),
    [
        (
            {"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}},
            "tensor_parallel.autotp_size",
        ),
        (
            _ltd(enabled=True, layer_token_lr_schedule={"enabled": True}),
            "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled",
        ),
        (
            {**_ltd(enabled=True), "sequence_parallel_size": 2},
            "data_efficiency.data_routing.random_ltd.enabled",
        ),
        (
            _ltd(enabled=True, random_ltd_schedule={"min_value": 9, "max_value": 8}),
            "data_efficiency.data_routing.random_ltd.random_ltd_schedule.min_value",
        ),
        (
            {"torch_autocast": {"enabled": True, "lower_precision_safe_modules": []}},
            "torch_autocast.lower_precision_safe_modules",
        ),
        (
            {"bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}},
            "data_types.param_dtype",
        ),
        (
            {
                "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                "zero_optimization": {"stage": 1},
            },
            "bf16.bf16_master_weights_and_grads",
        ),
    ],
)
def test_features_the_engine_does_not_run_are_refused_before_anything_is_built(
    config: dict[str, Any], key: str
) -> None:
    from deepshard.engine._checks import check_engine_config
    from deepshard.interface import ConfigError, DeepShardConfig

    with pytest.raises(ConfigError) as caught:
        check_engine_config(DeepShardConfig.from_dict(config))
    assert key in [path for path, _ in caught.value.problems]


def test_settings_without_effect_are_named() -> None:
    from deepshard.engine._checks import ignored_settings
    from deepshard.interface import DeepShardConfig

    config = {"tensorboard": {"enabled": True}, "bf16": {"enabled": True, "check_overflow": False}}
    lines = ignored_settings(DeepShardConfig.from_dict(config))
    assert [line.split(":")[0] for line in lines] == ["tensorboard", "bf16.check_grad_overflow"]


def test_a_config_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    import deepshard.engine as ds

    with pytest.raises(ds.ConfigError, match="path, a dict or a DeepShardConfig"):
        ds.initialize(torch.nn.Linear(2, 2), [("train_batch_size", 4)])  # type: ignore[arg-type]
    missing = tmp_path / "missing.json"
    with pytest.raises(ds.ConfigError):
        ds.initialize(torch.nn.Linear(2, 2), missing)


def test_zero_refusals_come_before_the_world_each_listed_once() -> None:
    from deepshard.engine._checks import check_engine_config
    from deepshard.interface import ConfigError, DeepShardConfig

    config = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "ratio": 0.5},
            "allgather_partitions": False,
        },
        "data_efficiency": {
            "data_routing": {
                "random_ltd": {"enabled": True, "layer_token_lr_schedule": {"enabled": True}}
            }
        },
    }
    with pytest.raises(ConfigError) as caught:
        check_engine_config(DeepShardConfig.from_dict(config))
    keys = [path for path, _ in caught.value.problems]
    # each refusal once, the feature table's and ZeRO's; stage 3 and its partial offload run
    assert sorted(keys) == [
        "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled",
        "zero_optimization.allgather_partitions",
    ]
