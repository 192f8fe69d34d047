"""Reading JSON and HJSON files, and to_dict giving back a config that parses to the same value."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from deepshard.interface import ConfigError, DeepShardConfig

HJSON_TEXT = """
{
  # comments, unquoted keys and unquoted strings (to the end of the line) are HJSON
  train_micro_batch_size_per_gpu: 2
  gradient_accumulation_steps: 4
  zero_optimization: {
    stage: 3
    offload_optimizer: {
      device: cpu
    }
  }
  optimizer: {
    type: AdamW
    params: {lr: 0.001}
  }
}
"""


def test_round_trip_of_a_rich_config() -> None:
    raw = json.loads((Path(__file__).parent / "configs" / "zero3_nvme_infinity.json").read_text())
    cfg = DeepShardConfig.from_dict(raw)
    again = DeepShardConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.to_dict() == cfg.to_dict()


def test_to_dict_without_defaults_keeps_only_what_differs() -> None:
    cfg = DeepShardConfig.from_dict(
        {"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}
    )
    assert cfg.to_dict(exclude_defaults=True) == {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
    }
    assert DeepShardConfig.from_dict(cfg.to_dict(exclude_defaults=True)) == cfg


def test_from_file_json(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16, "gradient_accumulation_steps": 2}))
    cfg = DeepShardConfig.from_file(path, dp_world_size=4)
    assert cfg.train_micro_batch_size_per_gpu == 16 // (2 * 4)


@pytest.mark.parametrize("name", ["ds.hjson", "ds.json"])
def test_from_file_hjson_by_extension_or_after_json_fails(tmp_path: Path, name: str) -> None:
    pytest.importorskip("hjson")
    path = tmp_path / name
    path.write_text(HJSON_TEXT)
    cfg = DeepShardConfig.from_file(path)
    assert cfg.zero_optimization.stage == 3
    assert cfg.zero_optimization.offload_optimizer is not None
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW"
    assert cfg.resolve_batch(2).train_batch_size == 2 * 4 * 2


def test_hjson_missing_gives_an_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "hjson", None)  # makes `import hjson` raise ImportError
    path = tmp_path / "ds.json"
    path.write_text(HJSON_TEXT)
    with pytest.raises(ConfigError, match=r"not valid JSON \(line .*deepshard-interface\[hjson\]"):
        DeepShardConfig.from_file(path)


def test_invalid_in_both_formats(tmp_path: Path) -> None:
    pytest.importorskip("hjson")
    path = tmp_path / "ds.json"
    path.write_text("{ a: [ }")
    with pytest.raises(ConfigError, match=r"not valid JSON .* and not valid HJSON"):
        DeepShardConfig.from_file(path)


@pytest.mark.parametrize("name", ["dup.json", "dup.hjson"])
def test_duplicate_keys_are_refused(tmp_path: Path, name: str) -> None:
    if name.endswith("hjson"):
        pytest.importorskip("hjson")
    path = tmp_path / name
    path.write_text('{"zero_optimization": {"stage": 1, "stage": 3}}')
    with pytest.raises(ConfigError, match="stage: the key appears twice"):
        DeepShardConfig.from_file(path)


def test_missing_file_and_non_object(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        DeepShardConfig.from_file(tmp_path / "absent.json")
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level must be a JSON object, got list"):
        DeepShardConfig.from_file(path)


def test_topology_from_config() -> None:
    cfg = DeepShardConfig.from_dict(
        {
            "tensor_parallel": {"autotp_size": 2},
            "sequence_parallel_size": 2,
            "moe": {"ep_size": 2, "num_experts": 4},
        }
    )
    topo = cfg.topology(16)
    assert (topo.tp, topo.sp, topo.ep, topo.dp, topo.pp) == (2, 2, 2, 16 // 8, 1)
    assert topo.batch_world_size == topo.dp * topo.ep
    autoep = DeepShardConfig.from_dict({"expert_parallel": {"enabled": True, "autoep_size": 4}})
    assert autoep.topology(8).ep == 4
