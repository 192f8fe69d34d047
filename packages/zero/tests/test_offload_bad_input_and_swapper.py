"""Optimizer offload's refusals name the key to change; the swapper moves raw bytes faithfully.

No process group is needed: every refusal is raised before ZeRO resolves its group, and the
swapper and the sub-group plan are functions of files and integers.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.accelerators import CpuAccelerator
from deepshard.interface import ConfigError, DeepShardConfig
from deepshard.interface.config import AioConfig, OffloadOptimizerConfig, ZeroConfig
from deepshard.interface.errors import CommError
from deepshard.zero import ZeroOptimizer, zero_problems
from deepshard.zero._offload_plan import SubGroup, offload_problems, plan_sub_groups
from deepshard.zero._offload_state import NvmeState, host_allocator
from deepshard.zero._swap import Swapper


def _keys(error: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return [path for path, _ in error.value.problems]


def _wrap(optimizer: torch.optim.Optimizer, zero: dict[str, Any], **kwargs: Any) -> None:
    ZeroOptimizer(optimizer, group=None, config=ZeroConfig(**zero), **kwargs)  # type: ignore[arg-type]


def _params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(3, 2).parameters())


def test_nvme_without_path_is_a_schema_error_and_param_offload_below_stage_3_is_ignored() -> None:
    with pytest.raises(ConfigError) as caught:
        DeepShardConfig.from_dict(
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
        )
    assert _keys(caught) == ["zero_optimization.offload_optimizer.nvme_path"]
    with pytest.warns(UserWarning, match="offload_param has no effect at stage 2"):
        config = DeepShardConfig.from_dict(
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
        )
    assert config.zero_optimization.offload_param is None  # as DeepSpeed, stage 3 reads it
    with pytest.raises(ConfigError) as caught:  # a mistake in it is still named
        DeepShardConfig.from_dict(
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}}
        )
    assert "zero_optimization.offload_param.nvme_path" in _keys(caught)


def test_offload_at_stage_0_and_sub_group_size_0_are_refused() -> None:
    config = ZeroConfig(stage=0, sub_group_size=0, offload_optimizer={"device": "cpu"})
    keys = [path for path, _ in zero_problems(config, gradient_clipping=1.0)]
    assert keys == ["zero_optimization.offload_optimizer", "zero_optimization.sub_group_size"]
    with pytest.raises(ConfigError) as caught:
        _wrap(torch.optim.AdamW(_params()), {"stage": 0, "offload_optimizer": {"device": "cpu"}})
    assert _keys(caught) == ["zero_optimization.offload_optimizer"]


def test_optimizers_that_cannot_step_on_the_host_are_refused() -> None:
    cpu = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(ConfigError) as caught:  # DeepSpeed's rule for client optimizers
        _wrap(torch.optim.SGD(_params(), lr=0.1), cpu)
    assert _keys(caught) == ["zero_force_ds_cpu_optimizer"]
    with pytest.raises(CommError, match="group=None"):  # past every check, to the fake group
        _wrap(torch.optim.SGD(_params(), lr=0.1), cpu, zero_force_ds_cpu_optimizer=False)
    nvme = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}
    with pytest.raises(ConfigError) as caught:
        _wrap(torch.optim.SGD(_params(), lr=0.1), nvme, zero_force_ds_cpu_optimizer=False)
    assert _keys(caught) == ["zero_optimization.offload_optimizer.device"]
    capturable = torch.optim.Adam(_params(), capturable=True)
    problems = offload_problems(ZeroConfig(**cpu), capturable, False, False)
    assert [p for p, _ in problems] == ["zero_optimization.offload_optimizer"]
    assert "capturable" in problems[0][1]
    muon = offload_problems(ZeroConfig(**cpu), torch.optim.AdamW(_params()), True, True)
    assert [p for p, _ in muon] == ["zero_optimization.offload_optimizer"]  # stage 2
    assert "stage 3" in muon[0][1]
    stage3 = ZeroConfig(**{**cpu, "stage": 3})  # Muon steps the host masters at stage 3
    assert offload_problems(stage3, torch.optim.AdamW(_params()), True, True) == []
    assert offload_problems(ZeroConfig(**cpu), torch.optim.AdamW(_params()), True, False) == []


def test_nvme_buffer_count_and_path_are_checked(tmp_path: Path) -> None:
    subs = plan_sub_groups([(0, 0, 10, 0)], 4)
    allocate = host_allocator(CpuAccelerator(), pin_memory=False)
    section = OffloadOptimizerConfig(device="nvme", nvme_path=tmp_path, buffer_count=2)
    with pytest.raises(ConfigError) as caught:
        NvmeState(
            [torch.zeros(10)], subs, section, AioConfig(), torch.float32, allocate, prefix="t"
        )
    assert _keys(caught) == ["zero_optimization.offload_optimizer.buffer_count"]
    with pytest.raises(ConfigError) as caught:
        Swapper(tmp_path / "missing", AioConfig(), prefix="t")
    assert _keys(caught) == ["zero_optimization.offload_optimizer.nvme_path"]


class _UnpinnedDevice:
    """An accelerator whose pin_empty cannot page-lock (as a device without pinning would)."""

    name = "cuda"

    def pin_empty(self, *size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty(size, dtype=dtype)


def test_pin_memory_warns_where_a_device_cannot_pin_and_not_on_the_cpu() -> None:
    with pytest.warns(UserWarning, match=r"offload_optimizer\.pin_memory"):
        allocate = host_allocator(_UnpinnedDevice(), pin_memory=True)  # type: ignore[arg-type]
    assert allocate(5, torch.bfloat16).shape == (5,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buffer = host_allocator(CpuAccelerator(), pin_memory=True)(7, torch.float32)
    assert buffer.dtype == torch.float32 and buffer.numel() == 7


def test_sub_groups_cover_each_partition_in_order_without_crossing_groups() -> None:
    subs = plan_sub_groups([(0, 0, 10, 0), (1, 0, 0, 1), (2, 0, 3, 2)], 4)
    assert subs == (
        SubGroup(0, 0, 0, 4),
        SubGroup(0, 1, 4, 8),
        SubGroup(0, 2, 8, 10),
        SubGroup(2, 0, 0, 3),
    )


@pytest.mark.parametrize(
    "aio",
    [
        {"block_size": 64, "queue_depth": 3, "intra_op_parallelism": 2},
        {"block_size": 100, "single_submit": True, "overlap_events": False},
    ],
)
def test_swapper_round_trips_raw_bytes_at_offsets(tmp_path: Path, aio: dict[str, Any]) -> None:
    swapper = Swapper(tmp_path, AioConfig(**aio), prefix="swap-")
    data = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    swapper.write("a", data[:600]).wait()
    swapper.write("a", data[600:], offset=1200).wait()  # bf16: element 600 at byte 1200
    assert swapper.path("a").stat().st_size == data.nbytes
    back = torch.empty_like(data)
    requests = [swapper.read("a", back[:300]), swapper.read("a", back[300:], offset=600)]
    for request in requests:
        request.wait()
    assert torch.equal(back, data)
    assert swapper.path("a").read_bytes() == data.view(torch.uint8).numpy().tobytes()
    directory = swapper.directory
    swapper.close()
    assert not directory.exists()
    swapper.close()  # idempotent


def test_build_zero_optimizer_passes_the_top_level_offload_keys() -> None:
    from deepshard.zero import build_zero_optimizer

    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    strict = DeepShardConfig.from_dict({"zero_optimization": zero})
    with pytest.raises(ConfigError) as caught:
        build_zero_optimizer(torch.optim.SGD(_params(), lr=0.1), strict, group=None)  # type: ignore[arg-type]
    assert _keys(caught) == ["zero_force_ds_cpu_optimizer"]
    lenient = DeepShardConfig.from_dict(
        {"zero_optimization": zero, "zero_force_ds_cpu_optimizer": False}
    )
    with pytest.raises(CommError, match="group=None"):
        build_zero_optimizer(torch.optim.SGD(_params(), lr=0.1), lenient, group=None)  # type: ignore[arg-type]
