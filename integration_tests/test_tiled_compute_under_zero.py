"""Tiled MLP and tiled loss train under ZeRO stages 2 and 3 exactly like their untiled versions.

ZeRO takes each parameter's gradient in a post-accumulate-grad hook and reduces it into its
partition. Tiled compute differentiates slice by slice; its parameter gradients reach autograd
once, after the last slice (deepshard.sequence_parallel._tiling), so ZeRO sees one final
gradient per parameter and pass. (Accumulating each slice's gradient into ``param.grad``
instead, as DeepSpeed does, makes ZeRO-2 refuse the second slice's gradient: "a gradient for
parameter 0 arrived after its bucket was reduced".)

On 2 gloo ranks (each its own data; masked labels with unequal valid tokens) a block
``x + MLP(x) -> lm_head -> cross entropy`` trains 3 AdamW steps with TiledMLP (3 slices) and
TiledFusedLogitsLoss (2 slices), and once untiled, at stage 2 and at stage 3; losses and final
parameters must agree. At stage 3 the tiled calls sit inside ZeRO units (the MLP and the head
modules), so their parameters are whole when the tiled op records them and again when its
backward recomputes; a tiled op outside such a unit is refused with a ConfigError that says so.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

B, S, H, INTER, V = 2, 6, 8, 16, 13
STEPS = 3


class MLP(torch.nn.Module):
    def __init__(self, tiled: bool) -> None:
        super().__init__()
        self.tiled = tiled
        self.gate = torch.nn.Linear(H, INTER, bias=False)
        self.up = torch.nn.Linear(H, INTER, bias=False)
        self.down = torch.nn.Linear(INTER, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepshard.sequence_parallel import TiledMLP

        return TiledMLP.apply(_mlp, self, x, 3) if self.tiled else _mlp(self, x)


class Head(torch.nn.Module):
    def __init__(self, tiled: bool) -> None:
        super().__init__()
        self.tiled = tiled
        self.proj = torch.nn.Linear(H, V, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        from deepshard.sequence_parallel import TiledFusedLogitsLoss

        if self.tiled:
            return TiledFusedLogitsLoss.apply(_loss, self, x, y, mask, 2, "mean")
        return _loss(self, x.reshape(-1, H), y.reshape(-1), mask.reshape(-1))


class Block(torch.nn.Module):
    def __init__(self, tiled: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = MLP(tiled)
        self.head = Head(tiled)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.mlp(x), y, mask)


def _mlp(m: MLP, x: torch.Tensor) -> torch.Tensor:
    return m.down(F.silu(m.gate(x)) * m.up(x))


def _loss(head: Head, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head.proj(x), y, reduction="none")[mask].mean()


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(B, S, H, generator=gen)
    y = torch.randint(0, V, (B, S), generator=gen)
    mask = torch.rand(B, S, generator=gen) > 0.3
    mask[0, 0] = True
    return x, y, mask


def _flat(block: Block) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in block.parameters()])


def _train(group: Any, rank: int, stage: int, tiled: bool) -> tuple[list[float], torch.Tensor]:
    import contextlib

    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    block = Block(tiled)
    inner = torch.optim.AdamW(block.parameters(), lr=1e-2)
    if stage == 3:
        policy = ZeroPolicy(unit_classes=(MLP, Head), param_persistence_threshold=0)
        sharded = shard(block, group=group, policy=policy)
        zero = ZeroOptimizer(inner, sharded, config=ZeroConfig(stage=3))
        gathered = sharded.gathered
    else:
        zero = ZeroOptimizer(inner, group=group, config=ZeroConfig(stage=2))
        gathered = contextlib.nullcontext
    losses = []
    for step in range(STEPS):
        loss = block(*_data(step, rank))
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        losses.append(float(loss))
    with gathered():
        return losses, _flat(block)


def _outside_a_unit(group: Any, rank: int) -> str:
    """Stage 3 with Linear units: the tiled op records released (empty) parameters."""
    from deepshard.interface.config import ZeroConfig
    from deepshard.interface.errors import ConfigError
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    block = Block(True)
    policy = ZeroPolicy(unit_classes=(torch.nn.Linear,), param_persistence_threshold=0)
    sharded = shard(block, group=group, policy=policy)
    zero = ZeroOptimizer(torch.optim.AdamW(block.parameters()), sharded, config=ZeroConfig(stage=3))
    try:
        zero.backward(block(*_data(0, rank)))
    except ConfigError as error:
        return str(error)
    return "no error"


def _rank_body(mesh: Any) -> dict[Any, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    out: dict[Any, Any] = {(s, t): _train(group, rank, s, t) for s in (2, 3) for t in (1, 0)}
    out["outside"] = _outside_a_unit(group, rank)
    return out


def test_tiled_training_under_zero_matches_untiled(run_on_mesh: Any) -> None:
    results = run_on_mesh(_rank_body, 2)
    initial = _flat(Block(False))
    for rank, result in enumerate(results):
        for stage in (2, 3):
            tiled_losses, tiled_params = result[(stage, True)]
            plain_losses, plain_params = result[(stage, False)]
            msg = f"rank {rank} stage {stage}"
            torch.testing.assert_close(tiled_losses, plain_losses, rtol=1e-5, atol=1e-6, msg=msg)
            torch.testing.assert_close(tiled_params, plain_params, rtol=1e-5, atol=1e-6, msg=msg)
            assert (plain_params - initial).abs().max() > 1e-3, f"{msg}: nothing trained"
    torch.testing.assert_close(results[0][(3, True)][1], results[1][(3, True)][1])
    torch.testing.assert_close(results[0][(2, True)][1], results[0][(3, True)][1])
    for result in results:
        assert "unit_classes" in result["outside"], result["outside"]
