"""A DeepSpeed job migrated mid-run with ``ds-checkpoint import-deepspeed`` trains on unchanged.

DeepSpeed 0.19.7 itself (the optional ``bench`` group; skipped without it, as in
``packages/checkpoint/tests/test_import_deepspeed_zero.py``) trains the writer's tiny model at
ZeRO-2 with AdamW on 2 gloo ranks for ``STEPS`` steps, saves, and keeps training ``MORE`` steps,
recording every rank's losses and its final fp32 masters (``deepspeed_writer.py --continue``).
The checkpoint is imported; a DeepShard engine built from the very same DeepSpeed config, on a
model whose weights and buffer were first moved away from the saved ones, loads it and trains
the same ``MORE`` steps on the same inputs. Its losses must equal DeepSpeed's on every rank
within 1e-5 (fp32) and its final weights DeepSpeed's: the masters, both Adam moments, Adam's
step (bias correction) and the weight decay all came across.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from deepshard.checkpoint.cli import main

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="DeepSpeed is not installed (uv sync --all-packages --group bench)",
    ),
    pytest.mark.timeout(1200),  # DeepSpeed's imports alone take a minute on a loaded 2-core box
]
WRITER = Path(__file__).parents[1] / "packages/checkpoint/tests/deepspeed_writer.py"
WORLD, STAGE, MORE = 2, 2, 4
DEEPSPEED_TIMEOUT_S = 900


def _writer() -> ModuleType:
    """The DeepSpeed writer script as a module: its model, inputs, loss and config."""
    spec = importlib.util.spec_from_file_location("deepspeed_writer", WRITER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _deepspeed_run(out: Path, tmp: Path) -> None:
    """DeepSpeed trains, saves after ``STEPS`` steps and trains ``MORE`` (2 processes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(tmp / "ext")}
    env["DS_ACCELERATOR"] = "cpu"
    command = [sys.executable, str(WRITER), str(STAGE), str(out), str(tmp / "store")]
    ranks = [
        subprocess.Popen(
            [*command, str(rank), str(WORLD), "--continue", str(MORE)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    try:
        outputs = [p.communicate(timeout=DEEPSPEED_TIMEOUT_S)[0] for p in ranks]
    finally:
        for process in ranks:
            process.kill()
    assert all(p.returncode == 0 for p in ranks), "\n".join(outputs)[-4000:]


def _resume(mesh: Any, imported: str, steps_run: int) -> dict[str, Any]:
    """One rank: a DeepShard engine of the same config loads the import and trains ``MORE``."""
    import deepshard.engine as ds

    writer = _writer()
    net = writer.model()
    with torch.no_grad():  # so that nothing below is equal by accident
        for param in net.parameters():
            param.add_(1.0)
        net.offset.zero_()
    engine, _, _, _ = ds.initialize(net, writer.config(STAGE), mesh=mesh)
    rank = mesh.get_rank()
    engine.load_checkpoint(imported)
    loaded = {k: v.clone() for k, v in engine.module_state_dict().items()}
    out: dict[str, Any] = {"loaded": loaded, "steps_at_load": engine.global_steps}
    losses = []
    for step in range(steps_run, steps_run + MORE):
        loss = writer.loss_of(engine(writer.batch(step, rank)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out["losses"] = losses
    out["final"] = {k: v.clone() for k, v in engine.module_state_dict().items()}
    engine.destroy()
    return out


def test_deepshard_resumes_a_deepspeed_zero2_run_after_import(
    tmp_path: Path, run_on_mesh: Any
) -> None:
    source = tmp_path / "ds"
    _deepspeed_run(source, tmp_path)
    steps_run = json.loads((source / "reference.json").read_text())["steps"]
    assert main(["import-deepspeed", str(source), str(tmp_path / "imported")]) == 0

    results = run_on_mesh(
        _resume, WORLD, args=(str(tmp_path / "imported"), steps_run), timeout_s=280
    )

    at_save = load_file(source / "reference.safetensors")
    final = load_file(source / "continued.safetensors")
    for rank, result in enumerate(results):
        assert result["steps_at_load"] == steps_run
        for name, value in result["loaded"].items():  # the import put DeepSpeed's masters in
            expected = at_save.get(f"param.{name}", torch.arange(3, dtype=torch.float32))
            assert torch.equal(value, expected), f"rank {rank}: {name} as loaded"
        deepspeed_losses = json.loads((source / f"continued-{rank}.json").read_text())
        torch.testing.assert_close(
            torch.tensor(result["losses"], dtype=torch.float64),
            torch.tensor(deepspeed_losses, dtype=torch.float64),
            rtol=0.0,
            atol=1e-5,
            msg=lambda m, r=rank: f"rank {r}: losses after the resume differ from DeepSpeed's: {m}",
        )
        for name, value in final.items():
            torch.testing.assert_close(
                result["final"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}"
            )
        moved = max((final[n] - at_save[f"param.{n}"]).abs().max().item() for n in final)
        assert moved > 1e-3, "DeepSpeed's extra steps changed nothing: the test would be vacuous"
