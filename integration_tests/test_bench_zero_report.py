"""`tools/bench/zero.py`'s line-up, configs and report, as functions of made-up data.

The smoke test runs the bench; this one pins what a run cannot show while DeepShard refuses
stage 3: how a measured stage-3 row is compared with FSDP2 and DeepSpeed (ratios computed here
from the rows given), how a refusal is reported (no number, exit 2), and that every competitor
gets the config its row name says.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from deepshard.interface.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "bench"))
import _zero_competitors  # (the bench's modules import each other by bare name)
import _zero_lineup
import _zero_report


def _row(best: float, rss: int, last_loss: float = 4.0) -> dict[str, object]:
    return {
        "best_s": best,
        "median_s": 2 * best,
        "rss_delta": rss,
        "losses": [5.0, last_loss],
        "params": 10,
        "tensor_bytes": None,
    }


def test_stages_parse_and_select_their_rows() -> None:
    assert _zero_lineup.parse_stages("0-2") == (0, 1, 2)
    assert _zero_lineup.parse_stages("3,0") == (0, 3)
    assert _zero_lineup.parse_stages("all") == (0, 1, 2, 3)
    for bad in ("4", "x", "", "1-5"):
        with pytest.raises(ValueError, match="--stages"):
            _zero_lineup.parse_stages(bad)
    names = [c.name for c in _zero_lineup.select((3,), None, "fp32")]
    assert names[:2] == ["fsdp2", "fsdp2-offload-all"] and "ddp" not in names
    assert "deepshard-3-offload-opt" in names and "deepspeed-3-offload-all" in names
    assert "ddp" not in [c.name for c in _zero_lineup.select((0,), None, "bf16")]
    bf16_masters = ["deepspeed-2-bf16-masters", "deepshard-2-bf16-masters"]
    assert [c.name for c in _zero_lineup.select((2,), None, "bf16")][-2:] == bf16_masters
    assert not set(bf16_masters) & {c.name for c in _zero_lineup.select((2,), None, "fp32")}
    with pytest.raises(ValueError, match="--competitors: unknown"):
        _zero_lineup.select((3,), ["fsdp3"], "fp32")
    with pytest.raises(ValueError, match="leaves no competitor"):
        _zero_lineup.select((3,), ["ddp"], "fp32")


def test_each_row_gets_the_config_its_name_says() -> None:
    def config(name: str, dtype: str = "fp32") -> dict[str, object]:
        return _zero_lineup.engine_config(_zero_lineup.BY_NAME[name], 4, dtype)

    plain = config("deepshard-3")
    assert plain["zero_optimization"] == {"stage": 3}
    assert plain["optimizer"]["params"]["torch_adam"] is True  # type: ignore[index]
    opt = config("deepspeed-3-offload-opt")
    assert opt["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    assert "torch_adam" not in opt["optimizer"]["params"]  # type: ignore[index]
    full = config("deepshard-3-offload-all", "bf16")
    assert full["zero_optimization"]["offload_param"] == {"device": "cpu"}  # type: ignore[index]
    assert full["bf16"] == {"enabled": True} and "bf16" not in plain
    assert config("deepspeed-3") == plain  # both engines get the same dict
    masters = config("deepshard-2-bf16-masters", "bf16")
    assert masters["bf16"] == {
        "enabled": True,
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
    }
    assert masters == config("deepspeed-2-bf16-masters", "bf16")
    assert masters["zero_optimization"] == config("deepshard-2")["zero_optimization"]
    assert _zero_competitors.fsdp2_policy("fp32").param_dtype is None
    bf16 = _zero_competitors.fsdp2_policy("bf16")
    assert bf16.param_dtype == bf16.reduce_dtype == torch.bfloat16


def test_measured_stage_3_rows_get_ratios_and_verdicts() -> None:
    rows = {
        "fsdp2": _row(1.0, 400),
        "deepspeed-3": _row(1.25, 500),
        "deepshard-3": _row(1.0, 300),
    }
    lines = _zero_report.verdicts(rows)
    assert lines == [
        "deepshard-3 / fsdp2: step time ratio 1.000 (target <= 0.95): MISSED by 0.050, "
        "median ratio 1.000, memory ratio 0.75",
        "deepshard-3 / deepspeed-3: step time ratio 0.800 (target <= 0.9): MET, "
        "median ratio 0.800, memory ratio 0.60",
        "deepshard-3 / fsdp2: peak RSS growth ratio 0.750 (target <= 1.0): MET",
        "deepshard-3 / deepspeed-3: peak RSS growth ratio 0.600 (no target)",
    ]
    assert _zero_report.exit_status(rows, _zero_report.loss_disagreements(rows, "fp32")) == 0


def test_a_refused_row_has_no_number_and_the_run_exits_2() -> None:
    error = ConfigError.from_problems([("zero_optimization.stage", "no"), ("a.b", "c")])
    reason = _zero_competitors.first_line(error)
    assert reason == "2 problems in the DeepShard config: - zero_optimization.stage: no"
    rows = {"fsdp2": _row(1.0, 400), "deepshard-3": {"refused": reason}}
    lines = _zero_report.table(rows)
    assert "| deepshard-3 | REFUSED | - | - | - | - |" in lines
    assert f"deepshard-3 refused: {reason}" in lines
    verdicts = _zero_report.verdicts(rows)
    assert len(verdicts) == 2 and all("REFUSED" in line for line in verdicts)
    assert not any(re.search(r"\d\.\d", line) for line in verdicts)  # no ratio stands in
    assert _zero_report.exit_status(rows, []) == _zero_report.EXIT_REFUSED
    merged = _zero_report.summarise([[{"refused": reason}, {"refused": reason}]])
    assert merged == {"refused": reason}


def test_a_loss_off_the_reference_fails_the_run() -> None:
    rows = {"fsdp2": _row(1.0, 1, last_loss=4.0), "deepspeed-3": _row(1.0, 1, last_loss=4.01)}
    problems = _zero_report.loss_disagreements(rows, "fp32")
    assert problems == ["deepspeed-3: last loss 4.010000 differs from fsdp2's 4.000000"]
    assert _zero_report.loss_disagreements(rows, "bf16") == []  # within bf16's 2e-2
    assert _zero_report.exit_status(rows, problems) == _zero_report.EXIT_FAILED
