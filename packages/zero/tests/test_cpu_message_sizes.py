"""On CPU (gloo) no bucket or all-gather call exceeds `CPU_MESSAGE_NUMEL`; other devices and
smaller configured sizes keep the config's values.

`message_numel` is checked for CPU parameters and for parameters on the ``meta`` device (which
stands for any accelerator: only ``cpu`` is capped). Then one ``run_on_mesh`` call on 2 ranks
wraps a 4.5M-parameter model at stage 1 with DeepSpeed's default sizes (5e8), which would make
it one bucket and one all-gather: it gets two buckets, each reduced and gathered by its own call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface.config import ZeroConfig
from deepshard.testing import run_on_mesh
from deepshard.zero._settings import CPU_MESSAGE_NUMEL, message_numel


def test_cpu_sizes_are_capped_and_others_kept() -> None:
    default = ZeroConfig()
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert default.reduce_bucket_size > CPU_MESSAGE_NUMEL
    assert message_numel(default.reduce_bucket_size, cpu) == CPU_MESSAGE_NUMEL
    assert message_numel(default.allgather_bucket_size, cpu) == CPU_MESSAGE_NUMEL
    assert message_numel(1000, cpu) == 1000
    assert message_numel(default.reduce_bucket_size, meta) == default.reduce_bucket_size


def _messages(mesh: Any) -> dict[str, Any]:
    from deepshard.comm import CommsLogger
    from deepshard.interface.config import CommsLoggerConfig
    from deepshard.zero import ZeroOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1500, 1500), torch.nn.Linear(1500, 1500))
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    zero = ZeroOptimizer(
        torch.optim.AdamW(model.parameters()),
        group=mesh["dp"],
        config=ZeroConfig(stage=1),
        comms_logger=logger,
    )
    zero.backward(model(torch.randn(2, 1500)).square().mean())
    zero.step()
    [layout] = zero.layouts
    messages: dict[str, list[int]] = {}
    for record in logger.records:
        messages.setdefault(record.op, []).append(record.msg_bytes)
    return {
        "numel": sum(p.numel() for p in model.parameters()),
        "buckets": [b.numel for b in layout.buckets],
        "messages": messages,
    }


@pytest.mark.slow
def test_a_large_cpu_model_is_reduced_and_gathered_in_capped_messages(tmp_path: Path) -> None:
    for result in run_on_mesh(_messages, 2, store_dir=tmp_path):
        assert result["numel"] > CPU_MESSAGE_NUMEL
        buckets = result["buckets"]
        assert len(buckets) == 2 and all(numel <= CPU_MESSAGE_NUMEL for numel in buckets)
        # one reduction and one all-gather per bucket, each moving exactly that bucket; on CPU
        # the reduction is an all-reduce (gloo's reduce-scatter is slower), beside the norm's
        messages = result["messages"]
        assert "reduce_scatter_tensor" not in messages
        assert sorted(messages["all_reduce"]) == sorted([16] + [4 * n for n in buckets])
        assert sorted(messages["all_gather_into_tensor"]) == sorted(4 * n for n in buckets)
