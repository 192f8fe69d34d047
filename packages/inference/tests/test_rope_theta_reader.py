"""The RoPE base is read where either transformers generation keeps it; scaled RoPE is refused.

Transformers 4.x: ``config.rope_theta``; transformers 5: ``config.rope_parameters["rope_theta"]``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepshard.inference._rope import DEFAULT_ROPE_THETA, check_rope_supported, rope_theta
from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside

models = import_beside(__file__, "_batch_models.py")


def test_reads_the_attribute_then_the_parameters_dict() -> None:
    assert rope_theta(SimpleNamespace(rope_theta=5e5)) == 5e5
    assert rope_theta(SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 3.0}))
    assert rope_theta(SimpleNamespace(rope_parameters={"rope_theta": 1234})) == 1234.0
    both = SimpleNamespace(rope_theta=7.0, rope_parameters={"rope_theta": 9.0})
    assert rope_theta(both) == 7.0


def test_the_installed_transformers_configs() -> None:
    config = models.tiny_qwen3().config
    assert rope_theta(config) == float(config.rope_parameters["rope_theta"])
    config.rope_parameters = {"rope_type": "default", "rope_theta": 42.0}
    assert rope_theta(config) == 42.0
    check_rope_supported(config)
    check_rope_supported(models.tiny_llama().config)


def test_missing_base_defaults_or_errors() -> None:
    assert rope_theta(SimpleNamespace()) == DEFAULT_ROPE_THETA
    assert rope_theta(SimpleNamespace(rope_parameters={"rope_type": "default"}), default=2.0) == 2.0
    with pytest.raises(ConfigError, match=r"names no RoPE base.*rope_parameters\['rope_theta'\]"):
        rope_theta(SimpleNamespace(rope_parameters={}), default=None)


@pytest.mark.parametrize("bad", [0, -1.0, "10000", True])
def test_bad_bases_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="must be a positive number"):
        rope_theta(SimpleNamespace(rope_parameters={"rope_theta": bad}))


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "llama3"])
def test_scaled_rope_types_are_refused(kind: str) -> None:
    config = models.tiny_llama().config
    config.rope_parameters = {"rope_type": kind, "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ConfigError, match=f"RoPE type '{kind}'.*supported: default"):
        check_rope_supported(config)
    legacy = SimpleNamespace(rope_theta=1e4, rope_scaling={"type": kind, "factor": 2.0})
    with pytest.raises(ConfigError, match=kind):
        check_rope_supported(legacy)
