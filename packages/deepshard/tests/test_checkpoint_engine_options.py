"""The ``checkpoint`` config block and the engine checkpoint options, on 2 gloo ranks.

* ``tag_validation``: ``FAIL`` refuses tags that differ across ranks (on every rank, before
  anything is written); ``WARN`` logs it and saves under rank 0's tag.
* ``async_save`` with ``keep_last: 2``: three saves while training continues leave the last two
  tags; loading the newest waits for it and gives the weights it was saved with; the first
  save copies into the host buffers the engine readied after its first optimizer step.
* A load without ``latest`` and without a tag lists the tags present; a ``client_state`` value
  that is neither JSON nor a tensor is refused by its key path.
* A damaged checkpoint found while filling (a flipped byte, checked where it landed) fails the
  load on every rank as a `PartialLoadError`; ``forward``, ``step`` and ``save_checkpoint`` then
  refuse to run until a good checkpoint loads, after which training goes on from it.
* ZeRO stage 3 with a frozen layer: ``exclude_frozen_parameters`` leaves it out of the files, a
  strict load of that checkpoint is refused and a lenient one keeps the fresh frozen weights;
  a full checkpoint restores them (written back into the stage-3 partitions).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from deepshard.checkpoint import list_tags, load_state_dict_from_checkpoint
from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones


def _engine(
    mesh: Any, seed: int, *, stage: int = 1, frozen: bool = False, **checkpoint: Any
) -> Any:
    import deepshard.engine as ds

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    if frozen:
        model[0].requires_grad_(False)
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
        "checkpoint": checkpoint,
    }
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    return engine


def _step(engine: Any, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.module_state_dict().items()}


def _error(call: Any) -> str:
    from deepshard.interface.errors import CheckpointError

    try:
        call()
    except CheckpointError as exc:
        return str(exc)
    return "no error"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _tags_and_async(mesh: Any, root: str) -> dict[str, Any]:
    rank, out = mesh.get_rank(), {}
    fail = _engine(mesh, 0, tag_validation="fail")
    out["fail"] = _error(lambda: fail.save_checkpoint(f"{root}/fail", tag=f"t{rank}"))
    warn = _engine(mesh, 0, tag_validation="warn")
    records = _Records()
    logging.getLogger("deepshard.engine").addHandler(records)
    warn.save_checkpoint(f"{root}/warn", tag=f"t{rank}", save_latest=False)
    out["warned"], out["warn_tags"] = records.messages, list_tags(f"{root}/warn")
    out["no_latest"] = _error(lambda: warn.load_checkpoint(f"{root}/warn"))
    out["bad_client"] = _error(
        lambda: warn.save_checkpoint(f"{root}/bad", client_state={"opts": {"fn": print}})
    )
    background = _engine(mesh, 0, async_save=True, keep_last=2)
    saved = []
    for step in range(3):
        _step(background, step)
        if step == 0:  # the first optimizer step readied the first save's host buffers
            prepared = background._pending_save
            out["prepared"] = prepared is not None and prepared.wait() == Path()
            pointers = {k: b.data_ptr() for k, b in prepared._host_buffers.items()}
        background.save_checkpoint(f"{root}/async")
        if step == 0:  # ... and that save copied into them instead of fresh memory
            used = background._pending_save._host_buffers
            out["reused"] = [k for k in pointers if used[k].data_ptr() == pointers[k]]
            # (An RNG row whose serialised size changed gets a fresh, small buffer.)
            out["prepared_keys"] = sorted(k for k in pointers if not k.startswith("rng/"))
        saved.append(_weights(background))
        _step(background, 10 + step)  # training goes on while the save is written
    background.load_checkpoint(f"{root}/async")  # waits for its own last save first
    out["async_tags"] = list_tags(f"{root}/async")
    reader = _engine(mesh, 5, async_save=True, keep_last=2)
    path, _ = reader.load_checkpoint(f"{root}/async")
    out["async_path"] = path
    out["async_equal"] = all(torch.equal(v, _weights(reader)[k]) for k, v in saved[-1].items())
    return out


def _frozen(mesh: Any, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    engine = _engine(mesh, 0, stage=3, frozen=True)
    _step(engine, 0)
    out["saved"] = _weights(engine)
    engine.save_checkpoint(f"{root}/slim", exclude_frozen_parameters=True)
    engine.save_checkpoint(f"{root}/full")
    fresh = _engine(mesh, 1, stage=3, frozen=True)
    out["fresh"] = _weights(fresh)
    out["strict"] = _error(lambda: fresh.load_checkpoint(f"{root}/slim"))
    fresh.load_checkpoint(f"{root}/slim", load_module_strict=False)
    out["lenient"] = _weights(fresh)
    fresh.load_checkpoint(f"{root}/full")
    out["full"] = _weights(fresh)
    return out


def _damaged(mesh: Any, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    engine = _engine(mesh, 0, stage=2)
    _step(engine, 0)
    engine.save_checkpoint(root, tag="good")
    out["good"] = _weights(engine)
    _step(engine, 1)
    out["second"] = _weights(engine)
    engine.save_checkpoint(root, tag="bad")
    dist.barrier()
    if mesh.get_rank() == 0:  # a byte near the end of rank 1's file: inside its data
        (path,) = Path(root, "bad").glob("rank-00001-*.safetensors")
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    dist.barrier()
    fresh = _engine(mesh, 1, stage=2)
    try:
        fresh.load_checkpoint(root, tag="bad")
        out["load"] = "no error"
    except Exception as exc:
        out["load"] = f"{type(exc).__name__}: {exc}"
    x = torch.randn(4, 5)
    out["forward"] = _error(lambda: fresh(x))
    out["step"] = _error(fresh.step)
    out["save"] = _error(lambda: fresh.save_checkpoint(root, tag="after"))
    fresh.load_checkpoint(root, tag="good")
    out["restored"] = _weights(fresh)
    _step(fresh, 1)  # training goes on: the step after "good", as the saving engine took it
    out["trained"] = _weights(fresh)
    return out


def test_tag_validation_async_keep_last_and_refusals(tmp_path: Path) -> None:
    per_rank = run_on_mesh(
        _tags_and_async, 2, args=(str(tmp_path / "ck"),), store_dir=tmp_path, timeout_s=240
    )
    for out in per_rank:
        assert "differs across ranks" in out["fail"] and "tag_validation=FAIL" in out["fail"]
        assert out["warn_tags"] == ["t0"]
        assert "no 'latest' file" in out["no_latest"] and "['t0']" in out["no_latest"]
        assert "client_state/opts/fn" in out["bad_client"]
        assert out["async_equal"] and Path(out["async_path"]).name == "global_step5"
        assert out["async_tags"] == ["global_step3", "global_step5"]
        assert out["prepared"] and out["prepared_keys"]
        assert set(out["prepared_keys"]) <= set(out["reused"])  # weights and moments: all
    assert not (tmp_path / "ck" / "fail").exists() or not list_tags(tmp_path / "ck" / "fail")
    assert any("differs across ranks" in m for m in per_rank[0]["warned"])


def test_frozen_parameters_at_stage3(tmp_path: Path) -> None:
    per_rank = run_on_mesh(
        _frozen, 2, args=(str(tmp_path / "ck"),), store_dir=tmp_path, timeout_s=240
    )
    slim = load_state_dict_from_checkpoint(tmp_path / "ck" / "slim")
    full = load_state_dict_from_checkpoint(tmp_path / "ck" / "full")
    assert "module/0.weight" not in slim and "module/2.weight" in slim
    assert torch.equal(full["module/0.weight"], per_rank[0]["saved"]["0.weight"])
    for out in per_rank:
        assert "module tensors" in out["strict"] and "module/0.weight" in out["strict"]
        assert torch.equal(out["lenient"]["0.weight"], out["fresh"]["0.weight"])
        assert torch.equal(out["lenient"]["2.weight"], out["saved"]["2.weight"])
        assert all(torch.equal(out["full"][k], v) for k, v in out["saved"].items())


def test_a_load_failing_while_filling_stops_training_until_a_good_load(tmp_path: Path) -> None:
    per_rank = run_on_mesh(
        _damaged, 2, args=(str(tmp_path / "ck"),), store_dir=tmp_path, timeout_s=240
    )
    assert not (tmp_path / "ck" / "after").exists()
    for out in per_rank:
        assert out["load"].startswith("PartialLoadError: rank 1:"), out["load"]
        assert "rank-00001-of-00002.safetensors does not match its XXH3-64" in out["load"]
        for call in ("forward", "step", "save"):
            assert f"engine.{call}" in out[call] and "partly overwritten" in out[call], out[call]
        assert all(torch.equal(out["restored"][k], v) for k, v in out["good"].items())
        assert all(torch.equal(out["trained"][k], v) for k, v in out["second"].items())
