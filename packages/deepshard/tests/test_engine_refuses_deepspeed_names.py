"""A DeepSpeed engine name DeepShard leaves out raises an ``AttributeError`` saying what instead.

* Every name in the one table (`deepshard.engine._unsupported.REFUSED_ENGINE_NAMES`) is absent
  from the engine class, so the lookup really reaches the table.
* On a real engine (1 gloo rank), each listed name raises ``AttributeError`` with its reason;
  ``hasattr`` is False for them; a config reader's message names a field that exists on the
  engine's config (the path is followed on the live engine); an unknown name gets Python's usual
  message naming the module too, and the module's own parameters, submodules, attributes and
  methods are reached through the engine (DeepSpeed's engine falls back to its module).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from deepshard.engine import DeepShardEngine
from deepshard.engine._unsupported import CONFIG_READERS, REFUSED_ENGINE_NAMES
from deepshard.testing import run_on_mesh

_CONFIG = {
    "train_batch_size": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
}


def test_every_refused_name_is_absent_from_the_engine_class() -> None:
    present = [name for name in REFUSED_ENGINE_NAMES if hasattr(DeepShardEngine, name)]
    assert present == []
    assert set(CONFIG_READERS) <= set(REFUSED_ENGINE_NAMES)


def _lookups(mesh: Any) -> dict[str, Any]:
    import deepshard.engine as ds

    engine = ds.initialize(model=torch.nn.Linear(2, 2), config=_CONFIG, mesh=mesh).engine
    messages = {}
    for name in REFUSED_ENGINE_NAMES:
        try:
            getattr(engine, name)
        except AttributeError as error:
            messages[name] = (str(error), error.name)
    followed = {
        name: repr(functools.reduce(getattr, ["parts", "config", *path.split(".")], engine))
        for name, path in CONFIG_READERS.items()
    }
    unknown = ""
    try:
        engine.no_such_method  # noqa: B018 (the lookup is the test)
    except AttributeError as error:
        unknown = str(error)
    return {
        "messages": messages,
        "hasattr": [name for name in REFUSED_ENGINE_NAMES if hasattr(engine, name)],
        "followed": followed,
        "unknown": unknown,
        "module_weight": tuple(engine.module.weight.shape),
        # the module's own attributes and methods, as DeepSpeed's engine falls back to them
        "passthrough": (
            engine.in_features,
            engine.reset_parameters == engine.module.reset_parameters,
        ),
    }


def test_a_refused_name_says_what_to_use_instead() -> None:
    (got,) = run_on_mesh(_lookups, 1, timeout_s=60)
    messages = got["messages"]
    assert set(messages) == set(REFUSED_ENGINE_NAMES)
    for name, (message, attribute) in messages.items():
        assert attribute == name
        assert (
            message
            == f"'DeepShardEngine' object has no attribute '{name}': "
            + (REFUSED_ENGINE_NAMES[name])
        )
    assert got["hasattr"] == []
    assert "engine.backward(loss)" in messages["train_batch"][0]
    assert "engine.load_checkpoint(load_dir)" in messages["load_universal_checkpoint"][0]
    assert "zero_optimization.reduce_bucket_size" in messages["zero_reduce_bucket_size"][0]
    assert set(got["followed"]) == set(CONFIG_READERS)
    assert got["followed"]["optimizer_name"] == repr("AdamW")
    assert got["unknown"] == (
        "'DeepShardEngine' object has no attribute 'no_such_method', and neither has its "
        "module (Linear)"
    )
    assert got["passthrough"] == (2, True)
    assert got["module_weight"] == (2, 2)
