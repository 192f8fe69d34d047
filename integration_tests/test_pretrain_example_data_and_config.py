"""The pretraining example's functions of data, without processes: the split, the batches, the
config it hands the engine, and its answers to bad input."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "pretrain" / "train.py"


@pytest.fixture(scope="module")
def train() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pretrain_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _folder(tmp_path: Path, count: int) -> Path:
    for i in range(count):
        (tmp_path / f"f{i:02d}.py").write_bytes(bytes([65 + i]) * 10)
    return tmp_path


def test_every_tenth_sorted_file_is_held_out(train: ModuleType, tmp_path: Path) -> None:
    text, held, n_files = train.read_corpus(_folder(tmp_path, 12), "*.py")
    assert n_files == 12
    # Files 0 and 10 (bytes "A" and "K") are held out; the others are training text.
    assert bytes(held.tolist()) == b"A" * 10 + b"\n" + b"K" * 10
    assert set(bytes(text.tolist())) == set(b"BCDEFGHIJL\n")


def test_too_few_files_name_the_flag(train: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--data .*: found 1 files matching --glob '\*.py'"):
        train.read_corpus(_folder(tmp_path, 1), "*.py")
    with pytest.raises(SystemExit, match=r"found 0 files matching --glob '\*.txt'"):
        train.read_corpus(tmp_path, "*.txt")


def test_batches_depend_only_on_seed_step_and_rank(train: ModuleType) -> None:
    text = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    args = {"size": 4, "seq_len": 16, "seed": 0}
    a = train.train_batch(text, step=3, rank=1, **args)
    assert torch.equal(a, train.train_batch(text, step=3, rank=1, **args))  # a resumed run
    assert not torch.equal(a, train.train_batch(text, step=3, rank=0, **args))
    assert not torch.equal(a, train.train_batch(text, step=4, rank=1, **args))
    # Each row is a contiguous window of the text (consecutive bytes, modulo 256).
    assert bool(((a[:, 1:] - a[:, :-1]) % 256 == 1).all())


def test_config_follows_steps_and_falls_back_to_fp32_on_cpu(
    train: ModuleType, tmp_path: Path
) -> None:
    config, note = train.load_config(SCRIPT.parent / "ds_config.json", 7, cpu_bf16=False)
    params = config["scheduler"]["params"]
    assert params["total_num_steps"] == 7 and params["warmup_num_steps"] == 7
    shipped = json.loads((SCRIPT.parent / "ds_config.json").read_text())
    assert shipped["bf16"]["enabled"] and shipped["zero_optimization"]["stage"] == 3
    if not torch.accelerator.is_available():
        assert config["bf16"]["enabled"] is False and "--cpu-bf16" in note
        kept, _ = train.load_config(SCRIPT.parent / "ds_config.json", 7, cpu_bf16=True)
        assert kept["bf16"]["enabled"] is True


def test_bad_flags_are_refused_naming_them(train: ModuleType) -> None:
    with pytest.raises(SystemExit):
        train.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        train.parse_args(["--hidden-size", "100", "--heads", "3"])
