"""The engine cuts ``input_ids``/``labels`` to the curriculum's sequence length at each step.

One ``run_on_mesh`` call on 1 gloo rank trains a tiny token model through ``initialize`` with
2 micro-batches per step (so both forwards of a step share a length), for the legacy
``curriculum_learning`` section and for ``data_efficiency``'s (a ``seqlen`` metric plus a
custom user metric). The model records the lengths it saw. The same run uses
``engine.checkpointing`` (the config's section, on the mesh) for its block.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

SEQ, VOCAB, MICRO, STEPS = 16, 32, 2, 5


class _TokenModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU())
        self.head = torch.nn.Linear(32, VOCAB)
        self.seen: list[tuple[int, int]] = []
        self.checkpoint: Any = None

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.seen.append((input_ids.shape[1], labels.shape[1]))
        h = self.embed(input_ids)
        h = self.checkpoint(self.block, h) if self.checkpoint else self.block(h)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _train(mesh: Any, extra: dict[str, Any], custom: Any = None) -> dict[str, Any]:
    import deepshard.engine as ds

    model = _TokenModel()
    config = {
        "train_batch_size": 2 * MICRO,
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "activation_checkpointing": {
            "contiguous_memory_optimization": True,
            "number_checkpoints": 1,
        },
        **extra,
    }
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    model.checkpoint = engine.checkpointing.checkpoint
    if custom is not None:
        engine.set_custom_curriculum_learning_schedule(custom)
    rarity = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(2 * STEPS):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
        engine.backward(engine(input_ids=ids, labels=ids))
        engine.step()
        if "data_efficiency" in extra:
            rarity.append(engine.curriculum_difficulty("vocabularyrarity"))
    state = engine.curriculum_state_dict()
    engine.load_curriculum_state_dict({name: {"current_difficulty": 4} for name in state})
    reloaded = engine.curriculum_state_dict()
    return {
        "seen": model.seen,
        "state": state,
        "reloaded": reloaded,
        "rarity": rarity,
        "kept": engine.checkpointing.stats.kept_input_bytes,
        "legacy": engine.curriculum_enabled_legacy(),
        "new": engine.curriculum_learning_enabled(),
    }


LEGACY = {
    "curriculum_learning": {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": 4,
        "max_difficulty": SEQ,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 4},
    }
}
EFFICIENCY = {
    "data_efficiency": {
        "enabled": True,
        "data_sampling": {
            "enabled": True,
            "curriculum_learning": {
                "enabled": True,
                "curriculum_metrics": {
                    "seqlen": {
                        "min_difficulty": 8,
                        "max_difficulty": SEQ,
                        "schedule_type": "fixed_discrete",
                        "schedule_config": {"difficulty": [8, SEQ], "max_step": [2]},
                    },
                    "vocabularyrarity": {
                        "min_difficulty": 1,
                        "max_difficulty": 100,
                        "schedule_type": "custom",
                    },
                },
            },
        },
    }
}


def _both(mesh: Any) -> dict[str, Any]:
    return {
        "legacy": _train(mesh, LEGACY),
        "efficiency": _train(mesh, EFFICIENCY, custom={"vocabularyrarity": lambda s: 10 * s}),
    }


@pytest.fixture(scope="module")
def rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    (got,) = run_on_mesh(_both, 1, store_dir=tmp_path_factory.mktemp("cur"), timeout_s=120)
    return got


def test_legacy_seqlen_schedule_cuts_both_tensors(rank: dict[str, Any]) -> None:
    # fixed_linear 4 → 16 over 4 steps, multiples of 4: floor(s·3 + 4) = 7, 10, 13, 16, 19
    # → 4, 8, 12, 16, 16; each step's two micro-batches share the length
    lengths = [4, 8, 12, 16, 16]
    assert rank["legacy"]["seen"] == [(n, n) for n in lengths for _ in range(2)]
    assert rank["legacy"]["state"] == {"curriculum_learning": {"current_difficulty": SEQ}}
    assert rank["legacy"]["reloaded"] == {"curriculum_learning": {"current_difficulty": 4}}
    assert (rank["legacy"]["legacy"], rank["legacy"]["new"]) == (True, False)


def test_data_efficiency_metrics_seqlen_and_a_custom_user_metric(rank: dict[str, Any]) -> None:
    got = rank["efficiency"]
    lengths = [8, 8, 16, 16, 16]  # fixed_discrete: 8 up to step 2, then 16
    assert got["seen"] == [(n, n) for n in lengths for _ in range(2)]
    # read after each micro-step; the schedule moved at that step's forwards: 10·step
    assert got["rarity"] == [10 * s for s in range(1, STEPS + 1) for _ in range(2)]
    assert got["state"] == {
        "seqlen": {"current_difficulty": SEQ},
        "vocabularyrarity": {"current_difficulty": 10 * STEPS},
    }
    assert (got["legacy"], got["new"]) == (False, True)


def test_engine_checkpointing_ran_with_the_config(rank: dict[str, Any]) -> None:
    # the block's input (micro × seqlen × 8 fp32) was kept once per forward, in the one slot
    expected = sum(MICRO * n * 8 * 4 for n, _ in rank["legacy"]["seen"])
    assert rank["legacy"]["kept"] == expected
