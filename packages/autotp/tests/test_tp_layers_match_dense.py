"""Every TP layer on 2 gloo ranks equals the dense module it replaced, forward and backward.

One small model exercises each layer kind with uneven shards: a vocab-parallel embedding (with
a padding row), a fused gate_up column layer cut per sub-parameter, a row layer with a bias, a
row layer fed a whole input (split inside), and a column LM head with ``gather_output``. The
reference is the same model, unsharded, run on each rank; its gradients are sliced with plain
``torch.split`` (not the code under test) to compare with each rank's shard. The shard maps
are checked by rebuilding every weight from the ranks' shards with the interface's own
``rebuild``. Run with and without ``tp_overlap_comm``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepshard.autotp import LayerPlan, Style, TPPlan, parallelize, tp_state
from deepshard.interface import Topology
from deepshard.interface._shard_layout import rebuild
from deepshard.interface.config import TensorParallelConfig
from deepshard.testing import run_on_mesh

VOCAB, HIDDEN, INTER = 11, 6, 5


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN, padding_idx=3)
        self.gate_up = nn.Linear(HIDDEN, 2 * INTER)
        self.down = nn.Linear(INTER, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        y = x + self.down(F.silu(gate) * up)
        return self.head(y + self.mix(y))


# Per sub-parameter, rows per rank: uneven everywhere.
SIZES = {
    "emb": ((6, 5),),
    "gate_up": ((3, 2), (3, 2)),
    "down": ((3, 2),),
    "mix": ((4, 2),),
    "head": ((6, 5),),
}
STYLES = {"emb": Style.VOCAB, "gate_up": Style.COLUMN, "down": Style.ROW, "mix": Style.ROW}
DIMS = {"emb": 0, "gate_up": 0, "down": 1, "mix": 1, "head": 0}


def _plan() -> TPPlan:
    layers = tuple(
        LayerPlan(name, STYLES.get(name, Style.COLUMN), sizes, gather_output=name == "head")
        for name, sizes in SIZES.items()
    )
    return TPPlan(2, layers)


def _expected_shard(full: torch.Tensor, module: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard, from torch.split of each sub-parameter (independent of offsets)."""
    parts = SIZES[module]
    dim = DIMS[module]
    subs = full.split([sum(p) for p in parts], dim=dim)
    return torch.cat([sub.split(list(p), dim=dim)[rank] for sub, p in zip(subs, parts)], dim=dim)


def _ranks(mesh: Any, overlap: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = _Tiny()
    with torch.no_grad():
        for param in reference.parameters():
            param.normal_(0.0, 0.5)
    model = copy.deepcopy(reference)
    config = TensorParallelConfig(tp_overlap_comm=overlap)
    parallelize(model, mesh, config, plan=_plan())
    rank = mesh["tp"].get_local_rank()
    ids = torch.tensor([[0, 3, 5, 6, 10], [9, 3, 2, 7, 1]])
    target = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    out, expected = model(ids), reference(ids)
    F.cross_entropy(out.flatten(0, 1), target.flatten()).backward()
    F.cross_entropy(expected.flatten(0, 1), target.flatten()).backward()
    errors = {"logits": (out - expected).abs().max().item()}
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        module, _, kind = name.partition(".")
        ref = ref_params[name]
        sharded = not (kind == "bias" and STYLES.get(module) is Style.ROW)
        want_value = _expected_shard(ref.detach(), module, rank) if sharded else ref.detach()
        want_grad = _expected_shard(ref.grad, module, rank) if sharded else ref.grad
        assert param.grad is not None, name
        errors[f"{name}.value"] = (param.detach() - want_value).abs().max().item()
        errors[f"{name}.grad"] = (param.grad - want_grad).abs().max().item()
    state = tp_state(model)
    shards = {name: p.detach().reshape(-1).tolist() for name, p in model.named_parameters()}
    return {"errors": errors, "maps": state.shard_maps, "shards": shards,
            "full": {n: p.detach() for n, p in reference.named_parameters()}}  # fmt: skip


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "tp_overlap_comm"])
def test_each_layer_kind_matches_the_dense_module(tmp_path: Path, overlap: bool) -> None:
    results = run_on_mesh(
        _ranks, 2, topology=Topology(tp=2), args=(overlap,), store_dir=tmp_path, timeout_s=60
    )
    for rank, result in enumerate(results):
        bad = {k: v for k, v in result["errors"].items() if v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"
    maps, full = results[0]["maps"], results[0]["full"]
    assert set(maps) == {n for n in full if n != "down.bias"}
    for name, smap in maps.items():
        rebuilt = rebuild(smap, {r: results[r]["shards"][name] for r in range(2)})
        assert torch.allclose(torch.tensor(rebuilt).view_as(full[name]), full[name]), name
