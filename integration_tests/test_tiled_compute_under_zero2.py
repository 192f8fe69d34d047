"""Tiled MLP and tiled loss train under ZeRO stage 2 exactly like their untiled versions.

ZeRO-2 takes each parameter's gradient in a post-accumulate-grad hook and reduce-scatters it
into its partition. Tiled compute differentiates slice by slice; its parameter gradients reach
autograd once, after the last slice (deepshard.sequence_parallel._tiling), so ZeRO sees one
final gradient per parameter and pass. On 2 gloo ranks (each its own data, masked labels with
unequal valid tokens) a block ``x + MLP(x) -> lm_head -> cross entropy`` trains 3 steps of
AdamW under ZeRO-2 with TiledMLP (3 slices) and TiledFusedLogitsLoss (2 slices), and once
untiled; losses and final parameters must agree. (Accumulating each slice's parameter
gradient into ``param.grad`` instead, as DeepSpeed does, makes ZeRO-2 refuse the second slice's
gradient: "a gradient for parameter 0 arrived after its bucket was reduced".)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

B, S, H, INTER, V = 2, 6, 8, 16, 13
STEPS = 3


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate = torch.nn.Linear(H, INTER, bias=False)
        self.up = torch.nn.Linear(H, INTER, bias=False)
        self.down = torch.nn.Linear(INTER, H)
        self.head = torch.nn.Linear(H, V, bias=False)


def _mlp(block: Block, x: torch.Tensor) -> torch.Tensor:
    return block.down(F.silu(block.gate(x)) * block.up(x))


def _loss(block: Block, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(block.head(x), y, reduction="none")[mask].mean()


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(B, S, H, generator=gen)
    y = torch.randint(0, V, (B, S), generator=gen)
    mask = torch.rand(B, S, generator=gen) > 0.3
    mask[0, 0] = True
    return x, y, mask


def _train(group: Any, rank: int, tiled: bool) -> tuple[list[float], torch.Tensor]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.sequence_parallel import TiledFusedLogitsLoss, TiledMLP
    from deepshard.zero import ZeroOptimizer

    block = Block()
    zero = ZeroOptimizer(
        torch.optim.AdamW(block.parameters(), lr=1e-2), group=group, config=ZeroConfig(stage=2)
    )
    mlp_params = [block.gate.weight, block.up.weight, block.down.weight, block.down.bias]
    losses = []
    for step in range(STEPS):
        x, y, mask = _data(step, rank)
        if tiled:
            h = x + TiledMLP.apply(_mlp, block, x, 3, mlp_params)
            loss = TiledFusedLogitsLoss.apply(
                _loss, block, h, y, mask, 2, "mean", [block.head.weight]
            )
        else:
            h = x + _mlp(block, x)
            loss = _loss(block, h.reshape(-1, H), y.reshape(-1), mask.reshape(-1))
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        losses.append(float(loss))
    return losses, torch.cat([p.detach().reshape(-1) for p in block.parameters()])


def _rank_body(mesh: Any) -> dict[str, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    return {"tiled": _train(group, rank, True), "plain": _train(group, rank, False)}


def test_tiled_training_under_zero2_matches_untiled(run_on_mesh: Any) -> None:
    results = run_on_mesh(_rank_body, 2)
    initial = torch.cat([p.detach().reshape(-1) for p in Block().parameters()])
    for rank, result in enumerate(results):
        tiled_losses, tiled_params = result["tiled"]
        plain_losses, plain_params = result["plain"]
        torch.testing.assert_close(tiled_losses, plain_losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tiled_params, plain_params, rtol=1e-5, atol=1e-6)
        assert (plain_params - initial).abs().max() > 1e-3, f"rank {rank}: nothing trained"
    torch.testing.assert_close(results[0]["tiled"][1], results[1]["tiled"][1])
