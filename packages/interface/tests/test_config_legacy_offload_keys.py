"""Old configs' ``cpu_offload*`` switches: read as DeepSpeed 0.19.7 reads them, with a warning.

Off (false or null), a switch means no offload, the default; on, it becomes the section that
replaced it, which then meets that section's own rules. Each old key warns with a
``FutureWarning`` naming the key and its replacement.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from deepshard.interface import ConfigError, DeepShardConfig
from deepshard.interface.config import ZeroConfig


def _zero(section: dict[str, Any]) -> tuple[ZeroConfig, list[str]]:
    """The parsed section and the messages of the FutureWarnings parsing raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = DeepShardConfig.from_dict({"train_batch_size": 4, "zero_optimization": section})
    return config.zero_optimization, [
        str(w.message) for w in caught if issubclass(w.category, FutureWarning)
    ]


def _problem_keys(section: dict[str, Any]) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ConfigError) as info:
            DeepShardConfig.from_dict({"train_batch_size": 4, "zero_optimization": section})
    return [path for path, _ in info.value.problems]


@pytest.mark.parametrize(
    "switches",
    [
        {"cpu_offload": False},
        {"cpu_offload_param": False},
        {"cpu_offload": None, "cpu_offload_param": None},
        {"cpu_offload": False, "cpu_offload_param": False, "cpu_offload_use_pin_memory": False},
    ],
)
def test_switches_that_are_off_are_accepted_with_a_warning(switches: dict[str, Any]) -> None:
    zero, messages = _zero({"stage": 2, **switches})
    plain, none = _zero({"stage": 2})
    assert zero == plain and none == []
    assert zero.offload_optimizer is None and zero.offload_param is None
    assert len(messages) == len(switches)
    for key, message in zip(switches, messages, strict=True):
        assert message.startswith(f"zero_optimization.{key} is deprecated")
        assert ("pin_memory" if key.endswith("pin_memory") else "offload_") in message


def test_cpu_offload_on_becomes_optimizer_offload_to_cpu() -> None:
    zero, messages = _zero({"stage": 2, "cpu_offload": True})
    assert zero.offload_optimizer is not None and zero.offload_param is None
    assert zero.offload_optimizer.device == "cpu"
    assert zero.offload_optimizer.pin_memory is True  # the section's (and DeepSpeed's) default
    assert messages == [
        "zero_optimization.cpu_offload is deprecated (an old DeepSpeed spelling); read as "
        '"offload_optimizer": {"device": "cpu"}; write that instead'
    ]


def test_pin_memory_switch_applies_to_the_sections_the_switches_create() -> None:
    zero, messages = _zero(
        {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
         "cpu_offload_use_pin_memory": False}
    )  # fmt: skip
    assert zero.offload_optimizer is not None and zero.offload_param is not None
    assert (zero.offload_optimizer.device, zero.offload_optimizer.pin_memory) == ("cpu", False)
    assert (zero.offload_param.device, zero.offload_param.pin_memory) == ("cpu", False)
    assert "applied to offload_optimizer and offload_param" in messages[-1]
    # Next to a written-out section only, it changes nothing and says so.
    zero, messages = _zero(
        {"stage": 2, "offload_optimizer": {"device": "cpu"}, "cpu_offload_use_pin_memory": False}
    )
    assert zero.offload_optimizer is not None and zero.offload_optimizer.pin_memory is True
    assert "no effect here" in messages[0]


def test_mapped_sections_meet_the_normal_rules() -> None:
    zero, _ = _zero({"stage": 3, "cpu_offload_param": True})
    assert zero.offload_param is not None and zero.offload_param.device == "cpu"
    with pytest.warns(UserWarning, match="offload_param has no effect at stage 2"):
        config = DeepShardConfig.from_dict(
            {"train_batch_size": 4, "zero_optimization": {"stage": 2, "cpu_offload_param": True}}
        )
    assert config.zero_optimization.offload_param is None  # DeepSpeed: stage 3 only reads it


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}, "cpu_offload"),
        ({"cpu_offload": False, "offload_optimizer": {"device": "cpu"}}, "cpu_offload"),
        ({"stage": 3, "cpu_offload_param": True, "offload_param": {}}, "cpu_offload_param"),
        ({"cpu_offload": "yes"}, "cpu_offload"),
        ({"cpu_offload": True, "cpu_offload_use_pin_memory": 1}, "cpu_offload_use_pin_memory"),
    ],
)
def test_bad_or_doubled_switches_name_the_key(section: dict[str, Any], key: str) -> None:
    assert _problem_keys(section) == [f"zero_optimization.{key}"]


def test_the_section_alone_reads_them_too() -> None:
    with pytest.warns(FutureWarning, match=r"zero_optimization\.cpu_offload is deprecated"):
        zero = ZeroConfig(stage=1, cpu_offload=True)
    assert zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
    assert "cpu_offload" not in zero.model_dump(by_alias=True)
