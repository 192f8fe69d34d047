"""``torch.compile`` with ZeRO stage 3: ``engine.compile()`` and ``initialize(torch.compile(m))``
train like eager stage 3 and like one process, and never recompile once traced.

2 gloo ranks, an MLP 13→37→29→7 whose three layers are ``ModuleList`` children (so each is a
stage-3 unit and the root owns nothing), `STEPS` AdamW steps with clipping, backend
``aot_eager`` (dynamo + aot_autograd's forward/backward split, no code generation):

* eager stage 3 matches a single-process reference computed here (1e-5, the stage-3 bounds);
* ``engine.compile()`` and a model compiled before ``initialize`` give the same losses and final
  parameters as eager stage 3 (1e-6 relative: the same kernels run, only dispatch differs);
* the compiled runs record after every step dynamo's graph and frame counters; after step 2
  (at most one re-trace when the unit order is recorded) neither grows, and each unit's forward
  is at most one graph (three units of different shapes: at most three graphs);
* ``engine.module`` stays the real module (parameter names without ``_orig_mod.``) and
  ``is_compiled`` is set;
* stage 2 with ``engine.compile()`` matches eager stage 2.

Bad requests (``fullgraph`` at stage 3, a DeepCompile ``schedule``, compiled autograd) are
typed errors, checked without processes (and ``fullgraph`` on a pre-compiled model on a rank).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.engine._compile import check_compile_request
from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")

STEPS = 6
BACKEND = "aot_eager"
CASES = [(3, "eager"), (3, "engine"), (3, "pre"), (2, "eager"), (2, "engine")]


class Block(torch.nn.Module):
    """``tanh(linear(x))`` (the last block without tanh)."""

    def __init__(self, fan_in: int, fan_out: int, act: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(fan_in, fan_out)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.tanh(y) if self.act else y


class LayeredMLP(torch.nn.Module):
    """`_models.SIZES` as a ``ModuleList`` of blocks: each block is a stage-3 unit."""

    def __init__(self) -> None:
        super().__init__()
        sizes, n = _models.SIZES, len(_models.SIZES) - 1
        self.layers = torch.nn.ModuleList(
            Block(sizes[i], sizes[i + 1], act=i < n - 1) for i in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _make() -> LayeredMLP:
    torch.manual_seed(0)
    return LayeredMLP()


def _counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["frames"]["total"]


def _run_case(mesh: Any, stage: int, mode: str) -> dict[str, Any]:
    import torch._dynamo

    import deepshard.engine as ds

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rank, world = mesh.get_rank(), mesh.size()
    model = _make()
    given = torch.compile(model, backend=BACKEND) if mode == "pre" else model
    config = _models.engine_config(stage=stage, precision="fp32", ga=1)
    engine, optimizer, _, _ = ds.initialize(given, config, mesh=mesh)
    if mode == "engine":
        engine.compile(backend=BACKEND)
        engine.compile(backend=BACKEND)  # a second call does nothing
    losses, counts, seconds = [], [], []
    for step in range(STEPS):
        start = time.perf_counter()
        x, y = _models.micro_batch(_models.mlp_batch(step), micro=0, rank=rank, world=world, ga=1)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
        counts.append(_counts())
    sharded = optimizer.sharded_module if stage == 3 else None
    with sharded.gathered() if sharded is not None else torch.no_grad():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {
        "losses": losses,
        "params": params,
        "counts": counts,
        "seconds": seconds,
        "module_is_model": engine.module is model,
        "is_compiled": engine.is_compiled,
    }


def _train(mesh: Any) -> dict[Any, Any]:
    import deepshard.engine as ds

    results: dict[Any, Any] = {case: _run_case(mesh, *case) for case in CASES}
    config = _models.engine_config(stage=3, precision="fp32", ga=1)
    full = torch.compile(_make(), backend=BACKEND, fullgraph=True)
    try:
        ds.initialize(full, config, mesh=mesh)
    except ConfigError as error:
        results["fullgraph"] = str(error)
    return results


def _reference() -> dict[str, Any]:
    """One process, the whole batch: torch AdamW and ``clip_grad_norm_`` (all fp32)."""
    model = _make()
    opt = torch.optim.AdamW(model.parameters(), lr=_models.LR, weight_decay=_models.WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        x, y = _models.mlp_batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), _models.CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": dict(model.named_parameters())}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _assert_close(got: dict[str, Any], want: dict[str, Any], tol: float, what: Any) -> None:
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert abs(a - b) <= tol * abs(b), (what, i, a, b)
    assert set(got["params"]) == set(want["params"]), what
    for name, value in want["params"].items():
        assert _rel(got["params"][name], value.detach()) <= tol, (what, name)


def _mean_losses(per_rank: list[dict[Any, Any]], case: Any) -> dict[str, Any]:
    runs = [r[case] for r in per_rank]
    losses = [sum(run["losses"][i] for run in runs) / len(runs) for i in range(STEPS)]
    return {"losses": losses, "params": runs[0]["params"]}


def test_stage3_compiled_matches_eager_without_recompiles(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_train, 2, store_dir=tmp_path, timeout_s=240)
    _assert_close(_mean_losses(per_rank, (3, "eager")), _reference(), 1e-5, "eager vs one")
    for stage, mode in CASES:
        if mode == "eager":
            continue
        eager = _mean_losses(per_rank, (stage, "eager"))
        _assert_close(_mean_losses(per_rank, (stage, mode)), eager, 1e-6, (stage, mode))
        for r in per_rank:
            run = r[(stage, mode)]
            assert run["is_compiled"] and run["module_is_model"], (stage, mode)
            counts = run["counts"]
            assert counts[0][0] > 0, (stage, mode, counts)  # something was compiled
            assert counts[-1] == counts[1], (stage, mode, counts)  # no recompiles after step 2
            assert counts[-1][0] <= 3, (stage, mode, counts)  # at most a graph per unit
            steady = min(run["seconds"][2:])
            print(
                f"stage {stage} {mode}: first step {run['seconds'][0]:.2f} s, "
                f"steady {steady:.3f} s, graphs/frames {counts}"
            )
    for r in per_rank:
        steady = min(r[(3, "eager")]["seconds"][2:])
        print(f"stage 3 eager: steady {steady:.3f} s")
        assert not r[(3, "eager")]["is_compiled"]
        assert "fullgraph" in r["fullgraph"] and "stage 3" in r["fullgraph"]


def test_bad_compile_requests_are_typed_errors() -> None:
    with pytest.raises(ConfigError, match="fullgraph"):
        check_compile_request(
            stage=3,
            compile_kwargs={"fullgraph": True},
            schedule=None,
            compiled_autograd_enabled=False,
        )
    with pytest.raises(ConfigError, match="DeepCompile"):
        check_compile_request(
            stage=1, compile_kwargs={}, schedule=object(), compiled_autograd_enabled=False
        )
    with pytest.raises(ConfigError, match="compiled_autograd_enabled"):
        check_compile_request(
            stage=2, compile_kwargs={}, schedule=None, compiled_autograd_enabled=True
        )
    # below stage 3 fullgraph is the user's business; a backend in the kwargs is dropped
    kwargs = {"fullgraph": True, "backend": "eager", "mode": "default"}
    got = check_compile_request(
        stage=2, compile_kwargs=kwargs, schedule=None, compiled_autograd_enabled=False
    )
    assert got == {"fullgraph": True, "mode": "default"}
