"""`describe_plan` prints one line per planned module: name, style, sizes, source."""

from __future__ import annotations

import pytest

from deepshard.autotp import PLAN_ATTRIBUTE, Style, describe_plan, make_plan, plan_of
from deepshard.interface.config import TensorParallelConfig
from deepshard.testing import import_beside

models = import_beside(__file__, "_models.py")


def test_one_line_per_module_with_its_decision() -> None:
    model = models.phi3()
    config = TensorParallelConfig(preset_model="phi3")
    plan = make_plan(model, 2, config)
    text = describe_plan(plan)
    header, *lines = text.splitlines()
    assert header == f"AutoTP plan: tp_size=2, {len(plan.layers)} modules"
    assert [line.split()[0] for line in lines] == [entry.module for entry in plan.layers]
    qkv = next(line for line in lines if "qkv_proj" in line)
    assert qkv.split("  ")[0] == "model.layers.0.self_attn.qkv_proj"
    assert "[[32, 32], [8, 8], [8, 8]]" in qkv and qkv.endswith("preset:phi3")
    head = next(line for line in lines if line.startswith("lm_head"))
    assert "column +gather" in head
    # A plain model is planned on the spot; a parallelized one shows the plan it got.
    assert describe_plan(model, 2, config) == text
    with pytest.raises(TypeError, match="tp_size"):
        describe_plan(model)
    vars(model)[PLAN_ATTRIBUTE] = plan
    assert plan_of(model) is plan and describe_plan(model) == text


def test_replicated_modules_show_no_sizes() -> None:
    text = describe_plan(models.qwen3(), 2)
    norm = next(line for line in text.splitlines() if ".q_norm" in line)
    assert norm.split()[1:] == [Style.REPLICATE_GRAD_ALLREDUCE.value, "-", "tp_plan"]
