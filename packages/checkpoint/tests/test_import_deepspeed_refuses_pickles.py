"""A DeepSpeed-style checkpoint carrying a malicious pickle is refused and never runs.

The payload is an object whose ``__reduce__`` writes a marker file when unpickled. It sits in
the model states (as the ``lr_scheduler`` entry) and, in a second checkpoint, in a ZeRO
optimizer file. ``ds-checkpoint import-deepspeed`` must exit 1 with a `CheckpointError` naming
the file and saying it would need arbitrary unpickling, the marker must not exist, and nothing
is written. The last check proves the payload is live: plain ``torch.load`` runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepshard.checkpoint._deepspeed_import import read_deepspeed
from deepshard.checkpoint.cli import main
from deepshard.interface.errors import CheckpointError


class _WritesAFile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def _model_states(payload: object | None) -> dict[str, object]:
    return {
        "module": {"w": torch.ones(2, 2)},
        "buffer_names": [],
        "optimizer": {"state": {}, "param_groups": [{"params": [0]}]},
        "param_shapes": [{"w": torch.Size([2, 2])}],
        "lr_scheduler": payload,
        "global_steps": 1,
        "ds_version": "0.19.7",
    }


def _ds_dir(root: Path, model_payload: object | None, optim_payload: object | None) -> Path:
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    torch.save(_model_states(model_payload), tag / "mp_rank_00_model_states.pt")
    if optim_payload is not None:
        optim = {"optimizer_state_dict": {"zero_stage": 2, "loss_scaler": optim_payload}}
        torch.save(optim, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return root


@pytest.mark.parametrize("where", ["model_states", "optim_states"])
def test_malicious_pickle_is_refused_and_never_runs(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned.txt"
    payload = _WritesAFile(marker)
    source = _ds_dir(
        tmp_path / "ds",
        payload if where == "model_states" else None,
        payload if where == "optim_states" else None,
    )
    out = tmp_path / "out"
    assert main(["import-deepspeed", str(source), str(out)]) == 1
    error = capsys.readouterr().err
    assert f"{where}.pt" in error and "arbitrary unpickling" in error, error
    assert "exec" in error  # the refused global is named
    assert not marker.exists()
    assert not out.exists() or not any(out.iterdir())
    with pytest.raises(CheckpointError, match="DeepShard never runs code"):
        read_deepspeed(source)
    assert not marker.exists()

    # The payload is live: an unrestricted load runs it (what DeepSpeed's own loader does).
    file = next((source / "global_step1").glob(f"*{where}.pt"))
    torch.load(file, weights_only=False)
    assert marker.read_text() == "pwned"


def test_a_clean_file_of_the_same_shape_is_read(tmp_path: Path) -> None:
    source = _ds_dir(tmp_path / "ds", None, None)
    with pytest.raises(CheckpointError, match=r"optimizer has 1 parameters|no .step."):
        read_deepspeed(source)  # gets past unpickling to the content checks
