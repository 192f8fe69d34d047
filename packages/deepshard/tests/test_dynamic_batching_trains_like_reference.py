"""Dynamic batching through ``initialize``: 2 gloo ranks train like one process, and resume.

56 token sequences of 2-12 tokens, ``max_tokens`` 16, one packed group per micro-batch, 2
micro-batches per step, ZeRO stage 2 on 2 ranks (``train_batch_size`` 4 groups). Each rank
iterates the loader ``initialize`` built from ``training_data``; the test checks

* every micro-batch a rank received is the plan's (`plan_steps` for its rank and micro-step)
  and holds at most 16 tokens;
* losses and weights equal a single-process reference that runs every (rank, micro-step)
  micro-batch of a step, averages the gradients as the engine does, and steps
  ``torch.optim.AdamW`` at ``lr * samples_in_step / 4`` (``linear``);
* the engine's param groups hold the unscaled rate between steps (no compounding);
* a checkpoint after step 3, loaded into a fresh engine with a fresh loader, continues with
  the same micro-batches and bit-identical losses as the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.engine.dynamic_batching import plan_steps
from deepshard.interface.config import DynamicBatchingConfig
from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # two gloo ranks, two engines; the main run has it

VOCAB, SAMPLES, MAX_TOKENS, STEPS, LR = 24, 56, 16, 6, 1e-2
LENGTHS = [2 + (i * i * 7 + 3 * i) % 11 for i in range(SAMPLES)]  # steps of 8-10 samples
SECTION = {"enabled": True, "max_tokens": MAX_TOKENS, "lr_scaling_method": "linear"}


class _Tokens(torch.utils.data.Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(index)
        return {
            "input_ids": torch.randint(1, VOCAB, (LENGTHS[index],), generator=gen),
            "index": index,
        }


def _collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["input_ids"])] = sample["input_ids"]
    return {"input_ids": ids, "index": torch.tensor([s["index"] for s in samples])}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        del index
        logits = self.head(torch.tanh(self.embed(input_ids[:, :-1])))
        targets = input_ids[:, 1:]
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=0
        )


def _config() -> dict[str, Any]:
    return {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        "gradient_clipping": 0.0,  # (DeepSpeed's default is 1.0; the reference does not clip)
        "zero_optimization": {"stage": 2},
        "data_efficiency": {"data_sampling": {"dynamic_batching": SECTION}},
    }


def _run(engine: Any, batches: Any, steps: int) -> tuple[list[float], list[list[int]]]:
    losses, seen = [], []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        batch = next(batches)
        seen.append(batch["index"].tolist())
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, seen


def _rank_body(mesh: Any, folder: str) -> dict[str, Any]:
    import deepshard.engine as ds

    engine, _, loader, _ = ds.initialize(
        _Model(), _config(), training_data=_Tokens(), collate_fn=_collate, mesh=mesh
    )
    batches = iter(loader)
    first, seen_first = _run(engine, batches, 3)
    engine.save_checkpoint(folder, tag="step3")
    rest, seen_rest = _run(engine, batches, STEPS - 3)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    lrs = engine.get_lr()

    again, _, fresh_loader, _ = ds.initialize(
        _Model(), _config(), training_data=_Tokens(), collate_fn=_collate, mesh=mesh
    )
    again.load_checkpoint(folder, tag="step3")
    resumed, seen_resumed = _run(again, iter(fresh_loader), STEPS - 3)
    return {
        "losses": first + rest,
        "seen": seen_first + seen_rest,
        "params": params,
        "lrs": lrs,
        "resumed": resumed,
        "seen_resumed": seen_resumed,
        "rest": rest,
        "seen_rest": seen_rest,
    }


def _reference() -> dict[str, Any]:
    plan = plan_steps(
        LENGTHS, DynamicBatchingConfig(**SECTION), micro_batch_size=1, accumulation_steps=2,
        ranks=2, seed=1234,
    )  # fmt: skip
    model, data = _Model(), _Tokens()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses: dict[int, list[float]] = {0: [], 1: []}
    for step in range(STEPS):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for micro in range(2):
            for rank in range(2):
                batch = _collate([data[i] for i in plan.micro_batch(step, micro, rank)])
                loss = model(**batch)
                loss.backward()
                losses[rank].append(float(loss.detach()))
                for grad, p in zip(grads, model.parameters(), strict=True):
                    grad += p.grad / 4  # / accumulation steps, / ranks
                    p.grad = None
        for grad, p in zip(grads, model.parameters(), strict=True):
            p.grad = grad
        opt.param_groups[0]["lr"] = LR * plan.samples_in_step(step) / 4
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"plan": plan, "losses": losses, "params": params}


def test_two_ranks_train_like_one_process_and_resume(tmp_path: Path) -> None:
    ranks = run_on_mesh(_rank_body, 2, args=(str(tmp_path / "ckpt"),), timeout_s=240)
    ref = _reference()
    plan = ref["plan"]
    assert len({plan.samples_in_step(s) for s in range(STEPS)}) > 1, "steps should differ in size"
    for rank, out in enumerate(ranks):
        expected = [plan.micro_batch(s, m, rank) for s in range(STEPS) for m in range(2)]
        assert out["seen"] == expected
        assert all(sum(len_ for len_ in (LENGTHS[i] for i in mb)) <= MAX_TOKENS for mb in expected)
        torch.testing.assert_close(out["losses"], ref["losses"][rank], rtol=1e-5, atol=1e-6)
        for name, value in ref["params"].items():
            torch.testing.assert_close(out["params"][name], value, rtol=1e-5, atol=1e-6)
        assert out["lrs"] == [LR]  # the schedule's rate: the scale is undone after each step
        assert out["seen_resumed"] == out["seen_rest"]
        assert out["resumed"] == out["rest"]
