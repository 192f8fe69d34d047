"""``ds-checkpoint import-deepspeed`` converts ZeRO-2 and ZeRO-3 checkpoints DeepSpeed wrote.

DeepSpeed 0.19.7 itself (the optional ``bench`` group; skipped without it) trains a tiny model
on 2 gloo ranks and saves (`deepspeed_writer.py`, a script run as two subprocesses). Two
references, both DeepSpeed's own: the live engine's ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` (written by the writer beside the checkpoint), and
``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` for the weights. The imported
checkpoint must hold exactly those fp32 masters and Adam moments, Adam's step and the step
counters; a DeepSpeed universal checkpoint (``ds_to_universal`` of the ZeRO-2 one) imports to
the same tensors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepshard.checkpoint import load_state_dict_from_checkpoint, read_metadata, verify
from deepshard.checkpoint.cli import main

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="DeepSpeed is not installed (uv sync --all-packages --group bench)",
    ),
    pytest.mark.timeout(1200),  # DeepSpeed's imports alone take a minute on a loaded 2-core box
]
WRITER = Path(__file__).with_name("deepspeed_writer.py")
WORLD = 2
DEEPSPEED_TIMEOUT_S = 900


def _start(stage: int, root: Path, tmp: Path) -> tuple[Path, list[subprocess.Popen[str]]]:
    """Start DeepSpeed's 2-rank training and save at ``stage``."""
    out = root / f"ds-zero{stage}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(tmp / "ext")}
    env["DS_ACCELERATOR"] = "cpu"
    command = [sys.executable, str(WRITER), str(stage), str(out), str(tmp / f"store-{stage}")]
    ranks = [
        subprocess.Popen(
            [*command, str(r), str(WORLD), "--universal-info"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    return out, ranks


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Both stages' runs at once (4 processes): on a loaded box each takes minutes."""
    tmp = tmp_path_factory.mktemp("deepspeed")
    started = {stage: _start(stage, tmp, tmp) for stage in (2, 3)}
    try:
        outputs = {
            s: [p.communicate(timeout=DEEPSPEED_TIMEOUT_S)[0] for p in r]
            for s, (_, r) in started.items()
        }
    finally:
        for _, ranks in started.values():
            for process in ranks:
                process.kill()
    for stage, (_, ranks) in started.items():
        assert all(p.returncode == 0 for p in ranks), "\n".join(outputs[stage])[-4000:]
    return {stage: out for stage, (out, _) in started.items()}


def _check(imported: Path, reference: dict[str, torch.Tensor], steps: int) -> None:
    state = load_state_dict_from_checkpoint(imported)
    names = sorted(k.removeprefix("param.") for k in reference if k.startswith("param."))
    for name in names:
        assert torch.equal(state[f"module/{name}"], reference[f"param.{name}"]), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[f"optimizer/{name}/{moment}"], reference[f"{moment}.{name}"])
    assert float(state["optimizer/param_groups.0/step"]) == steps
    assert torch.equal(state["module/offset"], torch.arange(3, dtype=torch.float32))  # buffer


@pytest.mark.parametrize("stage", [2, 3])
def test_import_equals_deepspeeds_own_consolidation(
    written: dict[int, Path], stage: int, tmp_path: Path
) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    source = written[stage]
    reference = load_file(source / "reference.safetensors")
    summary = json.loads((source / "reference.json").read_text())
    assert main(["import-deepspeed", str(source), str(tmp_path / "out")]) == 0
    tag = (source / "latest").read_text().strip()
    imported = tmp_path / "out" / tag
    _check(imported, reference, summary["steps"])
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(source))
    state = load_state_dict_from_checkpoint(imported)
    for name, tensor in consolidated.items():
        assert torch.equal(state[f"module/{name}"], tensor), name
    meta = read_metadata(imported)["metadata"]
    assert meta["imported_from"]["layout"] == f"zero-{stage}"
    assert meta["imported_from"]["dp_world_size"] == WORLD
    assert meta["engine"]["global_steps"] == summary["steps"]
    assert verify(imported).ok


def test_universal_checkpoint_imports_to_the_same_tensors(
    written: dict[int, Path], tmp_path: Path
) -> None:
    source = written[2]
    tag = (source / "latest").read_text().strip()
    universal = tmp_path / "universal" / f"{tag}_universal"
    command = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(source / tag),
        "--output_folder",
        str(universal),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert main(["import-deepspeed", str(universal), str(tmp_path / "out"), "--out-tag", "u"]) == 0
    reference = load_file(source / "reference.safetensors")
    _check(
        tmp_path / "out" / "u",
        reference,
        json.loads((source / "reference.json").read_text())["steps"],
    )
    assert (
        read_metadata(tmp_path / "out" / "u")["metadata"]["imported_from"]["layout"] == "universal"
    )
