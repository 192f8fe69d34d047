"""The experts one rank owns, as stacked weights run with one grouped GEMM per projection.

Each expert is a gated MLP ``down(act(x·gateᵀ) * (x·upᵀ))``, the layout of transformers 5:
``gate_up_proj [E, 2I, H]`` (gate rows first, then up rows) and ``down_proj [E, H, I]``. The
rows of all local experts arrive expert-contiguous (``group_sizes`` rows for each), so one
``torch._grouped_mm`` per projection computes every expert at once where the device has the
kernel. On CUDA it is used as is. On CPU it is used once a probe (`_cpu_grouped_mm_agrees`, run
once per dtype and process: three experts, the middle one without rows, forward and backward) has
matched a per-expert loop, so a torch whose CPU kernel or backward is missing or wrong falls
back to the loop instead of training wrongly. Elsewhere, and where the probe fails, a loop over
the experts' row blocks runs the same products, skipping empty experts.

``torch._grouped_mm`` needs every stride and the data pointer 16-byte aligned (v0.19.7 fixed
crashes from unaligned expert slices). `aligned_expert_weight` copies a slice into fresh storage
(allocations are at least 16-byte aligned) so that alignment never depends on which experts a
rank was given; a shape whose rows cannot be aligned (an odd hidden size in bf16) falls back to
the loop instead of failing.

Expert-parallel gradients need one scale: a rank's experts receive the tokens of every rank of
the ``ep`` group, so their local gradient already sums the losses of ``ep`` ranks (``ep·sp``
where sequence parallelism splits tokens further), while the training loss is the mean over the
dense data-parallel ranks. `GroupedExperts` multiplies its weights' gradient by ``grad_scale``
(``expert_dp / dense_dp`` ranks) so that averaging over its placement's reduction group
(``dp``) gives exactly the gradient of the mean loss, as for dense parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GroupedExperts", "aligned_expert_weight", "grouped_mm_usable"]

_ALIGN_BYTES = 16


def aligned_expert_weight(source: torch.Tensor, *, requires_grad: bool = True) -> nn.Parameter:
    """A contiguous, 16-byte aligned copy of ``source`` as a new parameter."""
    copy = torch.empty(source.shape, dtype=source.dtype, device=source.device)
    copy.copy_(source.detach())
    assert copy.data_ptr() % _ALIGN_BYTES == 0, "allocator returned unaligned storage"
    return nn.Parameter(copy, requires_grad=requires_grad)


def _strides_aligned(tensor: torch.Tensor) -> bool:
    size = tensor.element_size()
    return tensor.data_ptr() % _ALIGN_BYTES == 0 and all(
        stride == 1 or (stride * size) % _ALIGN_BYTES == 0 for stride in tensor.stride()
    )


Activation = Callable[[torch.Tensor], torch.Tensor]


def _grouped(
    x: torch.Tensor, group_sizes: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    act_fn: Activation,
) -> torch.Tensor:  # fmt: skip
    """Every expert at once: one ``torch._grouped_mm`` per projection."""
    offsets = torch.cumsum(group_sizes, dim=0, dtype=torch.int32)
    hidden = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets)
    gate, up = hidden.chunk(2, dim=-1)
    out = torch._grouped_mm(act_fn(gate) * up, down.transpose(-2, -1), offs=offsets)
    return _DenseGrad.apply(out)  # type: ignore[no-any-return]


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    ``torch._grouped_mm``'s CPU backward refuses a gradient with zero strides ("Invalid
    strides/sizes"), which is what ``out.sum().backward()`` produces (an expanded scalar).
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _looped(
    x: torch.Tensor, group_sizes: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    act_fn: Activation,
) -> torch.Tensor:  # fmt: skip
    """The fallback: one pair of GEMMs per non-empty expert (host sync for the sizes)."""
    outputs = []
    blocks = torch.split(x, [int(s) for s in group_sizes.tolist()])
    # unbind, not gate_up[e]: one backward stacking every expert's gradient instead of a
    # zero-filled full-size gradient per indexed expert (a third of the step on CPU).
    gate_ups, downs = gate_up.unbind(0), down.unbind(0)
    for expert, block in enumerate(blocks):
        if block.shape[0] == 0:
            continue
        gate, up = F.linear(block, gate_ups[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(act_fn(gate) * up, downs[expert]))
    if not outputs:
        # No rows. The (empty) output must still depend on x and on the weights: otherwise
        # this rank's backward skips the dispatch all-to-all that its peers run (a hang)
        # and leaves the weights without a gradient.
        return x * 0.0 + 0.0 * (gate_up.sum() + down.sum())
    return torch.cat(outputs)


@functools.cache
def _cpu_grouped_mm_agrees(dtype: torch.dtype) -> bool:
    """Whether CPU ``torch._grouped_mm`` gives the loop's outputs and gradients in ``dtype``.

    Three experts (hidden 32, intermediate 16) get 5, 0 and 3 rows: an empty group between two
    others is where a wrong backward shows (its weight gradient must be zero and its
    neighbours' rows must not mix). Outputs and the gradients of the rows and of both weights
    are compared with the loop's after the same ops in ``dtype``.
    """

    # The probe differentiates; the first call may come from an eval forward (no_grad or
    # inference_mode), whose verdict would otherwise be cached as a failure for the process.
    # It may also come from inside an activation-checkpointed forward: identity saved-tensor
    # hooks keep its tensors out of the checkpoint's, which would otherwise count them in the
    # forward but not in the recomputation (cached by then) and refuse the backward.
    def same(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(same, same),
    ):
        return _probe_grouped_mm(dtype)


def _probe_grouped_mm(dtype: torch.dtype) -> bool:
    """The comparison `_cpu_grouped_mm_agrees` describes, with gradients enabled."""
    generator = torch.Generator().manual_seed(0)
    sizes = torch.tensor([5, 0, 3])

    def make(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype).requires_grad_(True)

    rows, experts = int(sizes.sum()), len(sizes)
    x, gate_up, down = make(rows, 32), make(experts, 32, 32), make(experts, 32, 16)
    grad_out = torch.randn(rows, 32, generator=generator).to(dtype)
    try:
        grouped = _grouped(x, sizes, gate_up, down, F.silu)
        got = (grouped, *torch.autograd.grad(grouped, (x, gate_up, down), grad_out))
    except (RuntimeError, NotImplementedError):
        return False
    looped = _looped(x, sizes, gate_up, down, F.silu)
    want = (looped, *torch.autograd.grad(looped, (x, gate_up, down), grad_out))
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return all(
        torch.allclose(a.float(), b.float(), rtol=tolerance, atol=tolerance)
        for a, b in zip(got, want, strict=True)
    )


def grouped_mm_usable(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run these operands (aligned, 16-bit or fp32).

    On CUDA the kernel is trusted; on CPU only once `_cpu_grouped_mm_agrees` for the dtype.
    """
    if not hasattr(torch, "_grouped_mm") or x.device.type not in ("cuda", "cpu"):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if x.device.type == "cpu" and not _cpu_grouped_mm_agrees(x.dtype):
        return False
    # Every row of the activations and of each (transposed) weight must start 16-byte aligned.
    return _strides_aligned(x) and all(_strides_aligned(w) for w in weights)


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by a constant."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """A rank's ``E / ep`` gated-MLP experts, computed together.

    Args:
        gate_up_proj: ``[E_local, 2I, H]`` stacked gate and up projections.
        down_proj: ``[E_local, H, I]`` stacked down projections.
        act_fn: The gate activation (the model's, e.g. SiLU).
        grad_scale: Multiplier of the weights' gradients (see the module docstring).
        use_grouped_mm: Use ``torch._grouped_mm`` where `grouped_mm_usable` allows.
    """

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        grad_scale: float = 1.0,
        use_grouped_mm: bool = True,
    ) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.grad_scale = grad_scale
        self.use_grouped_mm = use_grouped_mm

    @property
    def num_local_experts(self) -> int:
        """Experts this rank holds."""
        return int(self.gate_up_proj.shape[0])

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """Run ``group_sizes[e]`` consecutive rows of ``x`` through local expert ``e``.

        Args:
            x: ``[N, H]`` rows, expert-contiguous.
            group_sizes: ``[E_local]`` int64 rows per expert (``sum == N``).

        Returns:
            ``[N, H]`` expert outputs in the same row order.
        """
        gate_up, down = self._scaled_weights()
        path = _grouped if self.uses_grouped_mm(x) else _looped
        return path(x, group_sizes, gate_up, down, self.act_fn)

    def _scaled_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.grad_scale != 1.0:
            gate_up = _ScaleGrad.apply(gate_up, self.grad_scale)
            down = _ScaleGrad.apply(down, self.grad_scale)
        return gate_up, down

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether `forward` runs ``x`` with ``torch._grouped_mm`` (else the per-expert loop)."""
        weights = (self.gate_up_proj.transpose(-2, -1), self.down_proj.transpose(-2, -1))
        return self.use_grouped_mm and grouped_mm_usable(x, *weights)

    def forward_by_source(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The loop of `forward` on rows laid out as received: (source rank, local expert) blocks.

        Expert ``e`` runs once on the concatenation of its blocks from every source (the same
        rows, in the same order, as `forward` after regrouping), and its output is split back
        into those blocks, so the result equals regroup → `forward` → ungroup without the two
        row gathers and their scatter-add backward.

        Args:
            x: ``[N, H]`` rows, ``counts[s, e]`` of them for source ``s`` and local expert ``e``,
                source-major.
            counts: ``[ep, E_local]`` int64 rows per (source, local expert), ``sum == N``.

        Returns:
            ``[N, H]`` expert outputs in the order of ``x``.
        """
        ep, per_rank = counts.shape
        sizes = [int(c) for c in counts.reshape(-1).tolist()]
        blocks = torch.split(x, sizes)
        gate_up, down = self._scaled_weights()
        gate_ups, downs = gate_up.unbind(0), down.unbind(0)
        outputs: list[torch.Tensor | None] = [None] * len(sizes)
        for expert in range(per_rank):
            slots = [s * per_rank + expert for s in range(ep) if sizes[s * per_rank + expert]]
            if not slots:
                continue
            rows = blocks[slots[0]] if len(slots) == 1 else torch.cat([blocks[i] for i in slots])
            gate, up = F.linear(rows, gate_ups[expert]).chunk(2, dim=-1)
            out = F.linear(self.act_fn(gate) * up, downs[expert])
            for slot, piece in zip(slots, torch.split(out, [sizes[i] for i in slots]), strict=True):
                outputs[slot] = piece
        pieces = [o for o in outputs if o is not None]
        if not pieces:
            # No rows: keep x and the weights in the graph (see `_looped`).
            return x * 0.0 + 0.0 * (gate_up.sum() + down.sum())
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
