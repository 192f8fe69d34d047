"""The CPU Adam implementations `adam.py` races, each behind the same small interface.

Every competitor gets the same flat parameter and gradient (fp32, or with ``--dtype`` bf16/fp16
updated in place with fp32 moments, as DeepSpeedCPUAdam does), the same hyper-parameters
(AdamW, decoupled weight decay, bias correction on) and the same thread count, and is wrapped as
a `Subject`: a zero-argument ``step`` and the parameter it updates in place. Optimizer state is
created by the competitor itself (lazily, on the first step, for the torch and DeepSpeed
optimizers), so the harness's warm-up steps also pay for its allocation and first touch.

Thread count: the worker process that runs a competitor sets ``OMP_NUM_THREADS`` before start-up
and calls ``torch.set_num_threads``. DeepSpeed's op parallelises with ``#pragma omp parallel for``
and shares torch's OpenMP runtime (it does not link its own), so both settings reach it;
DeepShard's kernel is also told ``num_threads`` explicitly.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _adam_spec import BETAS, EPS, LR, WEIGHT_DECAY

_PARITY_ELEMENTS, _PARITY_STEPS = 100_003, 3  # odd, so SIMD tails are exercised
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Relative spacing of the 16-bit dtypes (one ulp is at most this times |x|) and their smallest.
_ULP = {torch.bfloat16: (2.0**-7, 2.0**-133), torch.float16: (2.0**-10, 2.0**-24)}


@dataclass
class Subject:
    """One competitor ready to run: ``step()`` updates ``param`` in place."""

    step: Callable[[], None]
    param: torch.Tensor


def _deepshard(param: torch.Tensor, grad: torch.Tensor, threads: int) -> Subject:
    from deepshard.kernels import cpu_adam_step

    # fp32 moments whatever the parameter dtype (DeepSpeedCPUAdam's default).
    exp_avg, exp_avg_sq = torch.zeros(param.shape), torch.zeros(param.shape)
    counter = itertools.count(1)

    def step() -> None:
        cpu_adam_step(
            param, grad, exp_avg, exp_avg_sq, step=next(counter), lr=LR, beta1=BETAS[0],
            beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True,
            bias_correction=True, num_threads=threads,
        )  # fmt: skip

    return Subject(step, param)


def _deepspeed(param: torch.Tensor, grad: torch.Tensor, threads: int) -> Subject:
    # The op is JIT-built for DeepSpeed's current accelerator; the CPU one is what we race.
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-untyped]
    from deepspeed.utils import logger  # type: ignore[import-untyped]

    logger.setLevel(logging.WARNING)  # it logs a banner per optimizer at INFO
    leaf = torch.nn.Parameter(param)
    leaf.grad = grad
    optimizer = DeepSpeedCPUAdam(
        [leaf], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True
    )
    return Subject(optimizer.step, param)


def _torch(implementation: str) -> Callable[[torch.Tensor, torch.Tensor, int], Subject]:
    def make(param: torch.Tensor, grad: torch.Tensor, threads: int) -> Subject:
        leaf = torch.nn.Parameter(param)
        leaf.grad = grad
        optimizer = torch.optim.AdamW(
            [leaf], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
            fused=implementation == "fused", foreach=implementation == "foreach",
        )  # fmt: skip
        return Subject(optimizer.step, param)

    return make


_MAKERS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], Subject]] = {
    "deepshard": _deepshard,
    "deepspeed": _deepspeed,
    "torch-fused": _torch("fused"),
    "torch-foreach": _torch("foreach"),
}


def inputs(elements: int, seed: int = 0, dtype: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """A parameter and a gradient of ``elements`` values, the same for every competitor."""
    generator = torch.Generator().manual_seed(seed)
    param = torch.empty(elements).uniform_(-1.0, 1.0, generator=generator)
    grad = torch.empty(elements).uniform_(-1e-2, 1e-2, generator=generator)
    return param.to(DTYPES[dtype]), grad.to(DTYPES[dtype])


def make(name: str, elements: int, threads: int, dtype: str = "fp32") -> Subject:
    """Builds competitor ``name`` over fresh inputs of ``elements`` parameters."""
    return _MAKERS[name](*inputs(elements, dtype=dtype), threads)


def why_unavailable(name: str, threads: int, dtype: str = "fp32") -> str | None:
    """Why ``name`` cannot run here (import or build failure), or None when it can.

    Builds the competitor on a tiny tensor and steps it once, so DeepSpeed's one-time JIT build
    of its op happens here and never inside a timed step. DeepShard's op falls back to its
    pure-torch twin when its extension cannot load; racing that would say nothing about the
    kernel, so it counts as unavailable.
    """
    if dtype != "fp32" and name.startswith("torch"):
        return f"torch.optim.AdamW keeps {dtype} moments for {dtype} parameters: other work"
    try:
        make(name, 64, threads, dtype).step()
        if name == "deepshard":
            from deepshard.kernels import kernel_report

            adam = kernel_report().op("cpu_adam_step")
            if not adam.compiled:
                return f"the compiled kernel is unavailable: {adam.fallback_reason}"
    except Exception as error:  # a benchmark reports any failure and races the rest
        return f"{type(error).__name__}: {error}".splitlines()[0]
    return None


def backend(name: str) -> str:
    """What ``name`` runs on here, for the report (call after `why_unavailable` said yes)."""
    if name == "deepshard":
        from deepshard.kernels import active_simd_path

        return f"compiled, {active_simd_path()} path"
    if name == "deepspeed":
        import deepspeed  # type: ignore[import-untyped]
        from deepspeed.ops.op_builder import CPUAdamBuilder  # type: ignore[import-untyped]

        builder = CPUAdamBuilder()
        flags = f"{builder.cpu_arch()} {builder.simd_width()}"
        return f"DeepSpeed {deepspeed.__version__} cpu_adam op, JIT-built with {flags}"
    return f"torch {torch.__version__}"


def parity_error(name: str, threads: int, dtype: str = "fp32") -> str | None:
    """Compares ``name`` with an fp64 ``torch.optim.AdamW`` reference after a few steps.

    Returns a description of the mismatch, or None when the update agrees to fp32 accuracy (for
    16-bit parameters: the reference rounds its parameters to the dtype after each step, and
    the two may differ by one ulp where they round differently): a fast kernel that computes
    something else must not win the race.
    """
    param, grad = inputs(_PARITY_ELEMENTS, seed=1, dtype=dtype)
    reference = torch.nn.Parameter(param.double())
    reference.grad = grad.double()
    oracle = torch.optim.AdamW(
        [reference], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False
    )
    subject = _MAKERS[name](param.clone(), grad.clone(), threads)
    for _ in range(_PARITY_STEPS):
        subject.step()
        oracle.step()
        if param.dtype != torch.float32:
            with torch.no_grad():  # a 16-bit parameter holds the rounded result of each step
                reference.copy_(reference.to(param.dtype).double())
    expected = reference.detach().float()
    got = subject.param.float()
    worst = (got - expected).abs().max().item()
    rtol, atol = _ULP.get(param.dtype, (1e-5, 1e-6))
    if torch.allclose(got, expected, rtol=rtol, atol=atol):
        return None
    return f"after {_PARITY_STEPS} steps its parameters differ from AdamW by up to {worst:.3g}"
