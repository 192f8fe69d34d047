"""``torch.nn.Embedding(sparse=True)`` trains at ZeRO stages 0-3, like the dense embedding.

Autograd gives such an embedding a sparse gradient, which ZeRO's flat buckets cannot hold as
it is (before, every stage failed with "reshape is not implemented for sparse tensors"): the
gradient hooks densify it, and it is reduced like any other. DeepSpeed's ``sparse_gradients:
true`` (an all-gather of the touched rows at stage 0, a bandwidth saving with the same result)
is accepted and reported as without effect. On 2 gloo ranks, three SGD steps of a model with a
sparse embedding (and that key set) must end at the weights of the same model with a dense
embedding, at every stage.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

VOCAB = 30


class _Model(torch.nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 6, sparse=sparse)
        self.head = torch.nn.Linear(6, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids))).pow(2).mean()


def _train(mesh: Any, stage: int, sparse: bool) -> dict[str, torch.Tensor]:
    import deepshard.engine as ds
    from deepshard.zero import GatheredParameters

    config: dict[str, Any] = {
        "train_batch_size": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": stage},
    }
    if sparse:
        config["sparse_gradients"] = True
    engine, *_ = ds.initialize(_Model(sparse), config, mesh=mesh)
    for step in range(3):
        gen = torch.Generator().manual_seed(10 * step + mesh.get_rank())
        ids = torch.randint(0, VOCAB, (2, 7), generator=gen)  # repeats within and across rows
        engine.backward(engine(ids))
        engine.step()
    named = dict(engine.module.named_parameters())
    if stage < 3:
        return {n: p.detach().clone() for n, p in named.items()}
    with GatheredParameters(list(named.values())):
        return {n: p.detach().clone() for n, p in named.items()}


def _both(mesh: Any) -> dict[tuple[int, bool], dict[str, torch.Tensor]]:
    return {(s, sparse): _train(mesh, s, sparse) for s in range(4) for sparse in (False, True)}


@pytest.mark.slow  # 2 gloo ranks, eight engines; the main run has it
def test_a_sparse_embedding_trains_like_a_dense_one_at_every_stage() -> None:
    for results in run_on_mesh(_both, 2, timeout_s=180):
        for stage in range(4):
            dense, sparse = results[(stage, False)], results[(stage, True)]
            assert not torch.equal(dense["embed.weight"], _Model(False).embed.weight.detach())
            for name, value in dense.items():
                torch.testing.assert_close(sparse[name], value, rtol=1e-6, atol=1e-7)


def test_sparse_gradients_is_accepted_and_reported() -> None:
    from deepshard.engine._checks import check_engine_config, ignored_settings
    from deepshard.interface import DeepShardConfig

    config = DeepShardConfig.from_dict({"sparse_gradients": True})
    check_engine_config(config)  # no ConfigError
    assert [line.split(":")[0] for line in ignored_settings(config)] == ["sparse_gradients"]
