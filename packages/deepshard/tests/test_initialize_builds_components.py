"""What ``initialize`` builds besides the engine: the loader, optimizer, schedule and reports.

One ``run_on_mesh`` call on 2 ranks laid out as 2 expert-parallel ranks (``dp=1, ep=2``, so
dense parameters are data-parallel over the flattened ``dp × ep`` group and the ranks read
different samples) checks:

* the data loader gives each rank disjoint micro-batches of the configured size through the
  caller's ``collate_fn``, together covering the dataset;
* a caller's optimizer, or a callable building one, wins over the config's section; a callable
  schedule is built on the wrapped optimizer and stepped once per applied step;
* without any optimizer the engine runs forward passes and refuses ``backward``;
* ``torch_autocast`` runs the forward in bfloat16 while the parameters stay fp32;
  ``fp16.auto_cast`` casts fp32 inputs for an fp16 model; ``data_types.param_dtype`` casts the
  model; ``train()``/``eval()`` reach the module;
* with ``steps_per_print`` rank 0, and only rank 0, logs a progress line per period, plus the
  wall-clock breakdown, the tensor bytes and the communication summary when asked.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_ADAM = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}


class _Squares(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> int:
        return index


def _loader(mesh: Any) -> dict[str, Any]:
    import deepshard.engine as ds

    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "optimizer": _ADAM}
    engine, _, loader, _ = ds.initialize(
        torch.nn.Linear(2, 2),
        config,
        training_data=_Squares(),
        collate_fn=lambda samples: {"ids": torch.tensor(samples)},
        mesh=mesh,
    )
    assert loader is not None
    batches = [batch["ids"].tolist() for batch in loader]
    return {"batches": batches, "micro": engine.train_micro_batch_size_per_gpu()}


def _components(mesh: Any) -> dict[str, Any]:
    import deepshard.engine as ds

    model = torch.nn.Linear(2, 2)
    client = torch.optim.SGD(model.parameters(), lr=0.5)
    config = {"train_batch_size": 4, "optimizer": _ADAM}
    _, optimizer, _, _ = ds.initialize(model, config, optimizer=client, mesh=mesh)
    assert optimizer is not None
    wins = optimizer.inner is client and optimizer.param_groups[0]["lr"] == 0.5

    model = torch.nn.Linear(2, 2)
    built: list[Any] = []
    engine, optimizer, _, _ = ds.initialize(
        model,
        {"train_batch_size": 4},
        optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
        lr_scheduler=lambda opt: built.append(opt) or torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
        mesh=mesh,
    )
    for _ in range(2):
        engine.backward(engine(torch.ones(2, 2)).sum())
        engine.step()
    return {
        "client_wins": wins,
        "callable_optimizer": isinstance(optimizer.inner, torch.optim.SGD),
        "schedule_on_wrapper": built == [optimizer],
        "lrs": engine.get_lr(),
    }


def _forward_only_and_autocast(mesh: Any) -> dict[str, Any]:
    import deepshard.engine as ds

    engine, optimizer, _, _ = ds.initialize(
        torch.nn.Linear(2, 2), {"train_batch_size": 2}, mesh=mesh
    )
    output = engine(torch.ones(1, 2))
    refused = ""
    try:
        engine.backward(output.sum())
    except ds.ConfigError as error:
        refused = error.problems[0][0]
    config = {"train_batch_size": 2, "optimizer": _ADAM, "torch_autocast": {"enabled": True}}
    model = torch.nn.Linear(2, 2)
    autocast, _, _, _ = ds.initialize(model, config, mesh=mesh)
    out = autocast(torch.ones(1, 2))
    autocast.backward(out.float().sum())
    autocast.step()
    fp16 = {"train_batch_size": 2, "optimizer": _ADAM, "fp16": {"enabled": True, "auto_cast": True}}
    half, _, _, _ = ds.initialize(torch.nn.Linear(2, 2), fp16, mesh=mesh)
    half_out = half(torch.ones(1, 2))  # an fp32 input reaches the fp16 model as fp16
    cast_model = torch.nn.Linear(2, 2)
    ds.initialize(
        cast_model, {"train_batch_size": 2, "data_types": {"param_dtype": "bf16"}}, mesh=mesh
    )
    half.eval()
    return {
        "auto_cast": half_out.dtype,
        "param_dtype_cast": cast_model.weight.dtype,
        "eval_reaches_module": not half.module.training,
        "no_optimizer": optimizer is None,
        "refused": refused,
        "autocast_dtype": out.dtype,
        "param_dtype": model.weight.dtype,
        "applied": autocast.was_step_applied(),
    }


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _progress(mesh: Any) -> list[str]:
    import deepshard.engine as ds

    handler = _Lines()
    log = logging.getLogger("deepshard.engine")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    config = {
        "train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": _ADAM,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "comms_logger": {"enabled": True},
    }
    engine, _, _, _ = ds.initialize(torch.nn.Linear(2, 2), config, mesh=mesh)
    for _ in range(8):  # 4 optimizer steps: lines at steps 2 and 4
        engine.backward(engine(torch.ones(1, 2)).pow(2).sum())
        engine.step()
    log.removeHandler(handler)
    return handler.lines


def _everything(mesh: Any) -> dict[str, Any]:
    return {
        "loader": _loader(mesh),
        "components": _components(mesh),
        "forward_only": _forward_only_and_autocast(mesh),
        "progress": _progress(mesh),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from deepshard.interface import Topology

    return run_on_mesh(
        _everything,
        2,
        topology=Topology(dp=1, ep=2),
        store_dir=tmp_path_factory.mktemp("init"),
        timeout_s=120,
    )


def test_the_loader_splits_the_data_over_ranks_in_micro_batches(
    results: list[dict[str, Any]],
) -> None:
    micro = results[0]["loader"]["micro"]
    assert micro == 2  # 8 samples per step / (2 accumulation steps × 2 ranks)
    per_rank = [[i for b in r["loader"]["batches"] for i in b] for r in results]
    assert all(len(b) == micro for r in results for b in r["loader"]["batches"])
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(20))


def test_the_callers_optimizer_and_schedule_win(results: list[dict[str, Any]]) -> None:
    got = results[0]["components"]
    assert got["client_wins"]
    assert got["callable_optimizer"]
    assert got["schedule_on_wrapper"]
    assert got["lrs"] == [0.25]  # StepLR halved 1.0 at each of the 2 applied steps


def test_forward_only_engine_and_autocast(results: list[dict[str, Any]]) -> None:
    got = results[0]["forward_only"]
    assert got["no_optimizer"]
    assert got["refused"] == "optimizer"
    assert got["autocast_dtype"] == torch.bfloat16  # CPU autocast's default dtype
    assert got["param_dtype"] == torch.float32
    assert got["applied"]
    assert got["auto_cast"] == torch.float16
    assert got["param_dtype_cast"] == torch.bfloat16
    assert got["eval_reaches_module"]


def test_progress_lines_on_rank_0_only(results: list[dict[str, Any]]) -> None:
    lines = results[0]["progress"]
    progress = [line for line in lines if line.startswith("step ")]
    assert [line.split(" |")[0] for line in progress] == ["step 2", "step 4"]
    for word in ("loss", "lr", "grad norm", "loss scale", "samples/s"):
        assert all(word in line for line in progress)
    assert sum(line.startswith("time per step (ms): forward") for line in lines) == 2
    assert sum(line.startswith("tensor bytes:") for line in lines) == 2
    # stage 2 on CPU all-reduces its buckets (gloo's reduce-scatter is slower)
    assert sum("zero_all_reduce_grads" in line for line in lines) == 2
    assert results[1]["progress"] == []
