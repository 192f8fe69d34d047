"""`initialize` and tensor parallelism: contradictory settings, the world and the mesh, the
loader's batches and the first-step input check.

Pure checks run in this process; two gloo ranks on a ``tp = 2`` mesh run ``initialize`` with
``training_data``: both TP ranks must draw the same batches from the loader it builds, a forward
of those batches passes the first-step check, and a second engine fed rank-dependent inputs
fails on both ranks with "inputs differ within the tensor-parallel group". A Llama whose
vocabulary (129 rows) AutoTP can only split unevenly is refused by ``initialize``, naming the
parameter, its rows per rank and the padding fix (ZeRO lays out even splits only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface.config import DeepShardConfig
from deepshard.interface.errors import ConfigError
from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}


def _config(**sections: Any) -> DeepShardConfig:
    return DeepShardConfig.from_dict({**BASE, **sections})


def test_conflicting_tp_sizes_name_both_keys() -> None:
    from deepshard.engine._tensor_parallel import tp_config_problems

    config = _config(tensor_parallel={"autotp_size": 2, "tp": {"tp_size": 4}})
    problems = tp_config_problems(config)
    assert [key for key, _ in problems] == ["tensor_parallel.autotp_size"]
    assert "tensor_parallel.tp.tp_size = 4" in problems[0][1]
    same = _config(tensor_parallel={"autotp_size": 2, "tp": {"tp_size": 2}})
    assert tp_config_problems(same) == []
    assert same.tensor_parallel.size == 2
    assert _config(tensor_parallel={"tp": {"tp_size": 4}}).tensor_parallel.size == 4


def test_tp_dtype_must_be_the_engine_precision() -> None:
    from deepshard.engine._checks import check_engine_config
    from deepshard.engine._tensor_parallel import tp_config_problems

    config = _config(bf16={"enabled": True}, tensor_parallel={"autotp_size": 2, "dtype": "fp16"})
    (problem,) = tp_config_problems(config)
    assert problem[0] == "tensor_parallel.dtype" and "bf16" in problem[1]
    with pytest.raises(ConfigError) as info:  # listed with the engine's other refusals
        check_engine_config(config)
    assert problem in info.value.problems
    # AutoTP's default dtype (fp16) is not a contradiction; an explicit matching one is neither
    assert (
        tp_config_problems(_config(bf16={"enabled": True}, tensor_parallel={"autotp_size": 2}))
        == []
    )
    matching = {"autotp_size": 2, "dtype": "bfloat16"}
    assert tp_config_problems(_config(bf16={"enabled": True}, tensor_parallel=matching)) == []


def test_an_explicit_tp_group_is_refused_with_its_key() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel\.tp\.tp_group") as info:
        _config(tensor_parallel={"tp": {"tp_group": object()}})
    assert "builds the tensor-parallel groups from the mesh" in str(info.value)


def test_tp_size_must_divide_the_world() -> None:
    from deepshard.engine._tensor_parallel import check_tp_layout

    config = _config(tensor_parallel={"autotp_size": 4})
    with pytest.raises(ConfigError, match=r"tensor_parallel\.autotp_size: 4 does not divide.* 6"):
        check_tp_layout(config, world_size=6)
    check_tp_layout(config, world_size=8)


def test_fingerprint_sees_values_order_and_shapes() -> None:
    from deepshard.engine._tensor_parallel import input_fingerprint

    x = torch.arange(6.0).reshape(3, 2)
    same = input_fingerprint((x.clone(),), {"labels": torch.ones(3)})
    assert torch.equal(input_fingerprint((x,), {"labels": torch.ones(3)}), same)
    for other in (x.flip(0), x + 1e-3, x.reshape(2, 3)[:1]):
        assert not torch.equal(input_fingerprint((other,), {"labels": torch.ones(3)}), same)


def _dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(8, 4, generator=gen))


def _on_tp_mesh(mesh: Any) -> dict[str, Any]:
    import deepshard.engine as ds
    from deepshard.comm import ParallelDims
    from deepshard.engine._tensor_parallel import check_tp_layout

    dims = ParallelDims.from_mesh(mesh)
    out: dict[str, Any] = {}
    try:
        check_tp_layout(_config(tensor_parallel={"tp": {"tp_size": 4}}), dims=dims)
    except ConfigError as exc:
        out["mesh_error"] = str(exc)
    torch.manual_seed(0)
    engine, _, loader, _ = ds.initialize(
        torch.nn.Linear(4, 2), dict(BASE), training_data=_dataset(), mesh=mesh
    )
    batches = [x for (x,) in loader]
    out["batches"] = batches
    engine(batches[0])  # the same batch on both tp ranks: the check passes
    engine(batches[1] + mesh.get_rank())  # checked once only
    torch.manual_seed(0)
    other, _, _, _ = ds.initialize(torch.nn.Linear(4, 2), dict(BASE), mesh=mesh)
    try:
        other(batches[0] + mesh.get_rank())
    except ConfigError as exc:
        out["input_error"] = str(exc)
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=129, num_attention_heads=2, **shape))
    try:
        ds.initialize(llama, dict(BASE), mesh=mesh)
    except ConfigError as exc:
        out["uneven_error"] = str(exc)
    return out


def test_tp_ranks_get_the_same_batches_and_differing_inputs_fail(tmp_path: Path) -> None:
    from deepshard.interface import Topology

    ranks = run_on_mesh(_on_tp_mesh, 2, topology=Topology(tp=2), store_dir=tmp_path, timeout_s=60)
    assert len(ranks[0]["batches"]) == 4  # dp = 1: each tp rank reads the whole dataset
    for a, b in zip(ranks[0]["batches"], ranks[1]["batches"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for rank in ranks:
        assert "inputs differ within the tensor-parallel group" in rank["input_error"]
        assert (
            "tensor_parallel.tp.tp_size: 4 differs from the mesh's tp axis of size 2"
            in (rank["mesh_error"])
        )
        assert (
            "AutoTP splits 'model.embed_tokens.weight' (and 1 more) unevenly"
            in (rank["uneven_error"])
        )
        assert "[[65, 64]]" in rank["uneven_error"]
        assert "pad_to_multiple_of=2" in rank["uneven_error"]
