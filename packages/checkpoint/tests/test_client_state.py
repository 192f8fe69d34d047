"""`split_client_state`: JSON values stay in metadata, tensors go to safetensors and come back,
anything else is refused naming its key path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepshard.checkpoint import (
    join_client_state,
    load_state_dict_from_checkpoint,
    read_metadata,
    save,
    split_client_state,
)
from deepshard.interface.errors import CheckpointError


def test_client_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    client = {
        "epoch": 3,
        "name": "run-a",
        "lr": [0.1, 0.01],
        "sampler": {"seed": 7, "offsets": torch.arange(4), "done": None},
        "pair": (1, torch.ones(2, dtype=torch.bfloat16)),
    }
    json_part, tensors = split_client_state(client)
    assert set(tensors) == {"client_state/sampler/offsets", "client_state/pair/1"}
    save(tensors, tmp_path, tag="t", metadata={"client_state": json_part})
    restored = join_client_state(
        read_metadata(tmp_path)["metadata"]["client_state"],
        load_state_dict_from_checkpoint(tmp_path),
    )
    assert restored["epoch"] == 3 and restored["lr"] == [0.1, 0.01] and restored["name"] == "run-a"
    assert torch.equal(restored["sampler"]["offsets"], torch.arange(4))
    assert restored["sampler"]["done"] is None and restored["pair"][0] == 1
    assert restored["pair"][1].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"opt": {"fn": print}}, r"client_state/opt/fn: a builtin_function_or_method"),
        ({"items": [1, {2, 3}]}, r"client_state/items/1: a set"),
        ({"bad": float("nan")}, r"client_state/bad: nan is not valid JSON"),
        ({"m": {1: "x"}}, r"client_state/m: key 1 cannot be stored"),
    ],
)
def test_unstorable_values_name_their_key(value: dict[str, object], where: str) -> None:
    with pytest.raises(CheckpointError, match=where):
        split_client_state(value)
