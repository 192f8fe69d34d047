"""DeepSpeed features DeepShard does not carry are refused with their own reason and replacement."""

from __future__ import annotations

from typing import Any

import pytest

from deepshard.interface import ConfigError, DeepShardConfig
from deepshard.interface.config._removed import (
    AMP_ENABLED_MESSAGE,
    KERNEL_INJECT_MESSAGE,
    REFUSED_KEYS,
    REFUSED_OPTIMIZERS,
    ZERO_BOOLEAN_MESSAGE,
)


def _nest(path: str, value: Any) -> dict[str, Any]:
    *parents, key = path.split(".")
    raw: dict[str, Any] = {key: value}
    for parent in reversed(parents):
        raw = {parent: raw}
    return raw


def _problems(raw: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        DeepShardConfig.from_dict(raw)
    return info.value.problems


@pytest.mark.parametrize("path", sorted(REFUSED_KEYS))
def test_refused_key_gets_its_specific_message(path: str) -> None:
    problems = _problems(_nest(path, {"enabled": False} if "." not in path else 1))
    assert problems == [(path, REFUSED_KEYS[path])]
    assert "unknown key" not in REFUSED_KEYS[path]


def test_every_message_names_an_alternative_or_action() -> None:
    for message in (*REFUSED_KEYS.values(), *REFUSED_OPTIMIZERS.values()):
        assert any(word in message for word in ("use", "write", "remove", "set", "scale")), message


@pytest.mark.parametrize("spelling", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "onebitadam"])
def test_compressed_communication_optimizers_are_refused(spelling: str) -> None:
    problems = _problems({"optimizer": {"type": spelling, "params": {"lr": 1e-3}}})
    assert problems == [("optimizer.type", REFUSED_OPTIMIZERS[spelling.lower()])]


@pytest.mark.parametrize("flag", [True, False])
def test_boolean_zero_optimization_is_refused(flag: bool) -> None:
    assert _problems({"zero_optimization": flag}) == [("zero_optimization", ZERO_BOOLEAN_MESSAGE)]


def test_apex_amp_is_refused_only_when_enabled() -> None:
    assert _problems({"amp": {"enabled": True, "opt_level": "O1"}}) == [
        ("amp.enabled", AMP_ENABLED_MESSAGE)
    ]
    assert (
        DeepShardConfig.from_dict({"amp": {"enabled": False, "opt_level": "O1"}}).amp.opt_level
        == "O1"
    )


def test_kernel_injection_is_refused_only_when_on() -> None:
    for key in ("replace_with_kernel_inject", "kernel_inject"):
        problems = _problems({"tensor_parallel": {key: True}})
        # Reported under DeepSpeed's JSON key whichever spelling was used.
        assert problems == [("tensor_parallel.kernel_inject", KERNEL_INJECT_MESSAGE)]
    assert not DeepShardConfig.from_dict(
        {"tensor_parallel": {"kernel_inject": False}}
    ).tensor_parallel.replace_with_kernel_inject


def test_deepspeed_removed_compression_message_names_the_replacement() -> None:
    [(path, message)] = _problems({"compression_training": {"weight_quantization": {}}})
    assert path == "compression_training" and "torchao" in message
