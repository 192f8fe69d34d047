"""The package table: every distribution of the architecture, with where it stands."""

from __future__ import annotations

from deepshard.interface.status._model import PackageStatus

__all__ = ["PACKAGES"]

PACKAGES: tuple[PackageStatus, ...] = (
    PackageStatus(
        "deepshard-interface",
        "deepshard.interface",
        "packages/interface",
        "config schema (pydantic), topology, protocols, errors; never imports torch",
        "available",
    ),
    PackageStatus(
        "deepshard-accelerators",
        "deepshard.accelerators",
        "packages/accelerators",
        "device abstraction over `torch.accelerator` (cpu, cuda, mps, xpu)",
        "available",
    ),
    PackageStatus(
        "deepshard-comm",
        "deepshard.comm",
        "packages/comm",
        "process groups, the named device mesh, collectives, comms logger",
        "available",
    ),
    PackageStatus(
        "deepshard-kernels",
        "deepshard.kernels",
        "kernels",
        "compiled ops (CPU Adam/Lion: AVX2, AVX-512, NEON, SVE; CUDA fused Adam) with "
        "pure-torch twins",
        "available",
    ),
    PackageStatus(
        "deepshard-optimizers",
        "deepshard.optimizers",
        "packages/optimizers",
        "Adam/AdamW, CPUAdam, Muon, Lion, DeepSpeed's LR schedules",
        "available",
    ),
    PackageStatus(
        "deepshard-zero",
        "deepshard.zero",
        "packages/zero",
        "ZeRO stages 0-3, `Init`, `GatheredParameters`, optimizer offload to CPU or NVMe at "
        "stages 1-3, parameter offload (also under `Init`, NVMe included), partial optimizer "
        "offload, Muon with CPU optimizer offload and `offload_states` at stage 3 (available); "
        "`super_offload` (planned)",
        "partial",
    ),
    PackageStatus(
        "deepshard-checkpoint",
        "deepshard.checkpoint",
        "packages/checkpoint",
        "sharded save/load, universal format, resharding, `ds-checkpoint`",
        "available",
    ),
    PackageStatus(
        "deepshard-autotp",
        "deepshard.autotp",
        "packages/autotp",
        "AutoTP plans (specs, presets, HF `tp_plan`, structure), per-model `AutoTPMeta`, "
        "KV-group shard sizes, `parallelize` and the TP layers, TP checkpoints",
        "available",
    ),
    PackageStatus(
        "deepshard-autoep",
        "deepshard.autoep",
        "packages/autoep",
        "`parallelize_experts` (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3), the fp32 router, "
        "`fused_weighted_sum`, ZeRO 1-3, `Init` per layer, AutoTP on one mesh, resharding "
        "checkpoints, expert TP, DeepSpeed's classic `MoE` (available); DeepEP (planned)",
        "partial",
    ),
    PackageStatus(
        "deepshard-sequence-parallel",
        "deepshard.sequence_parallel",
        "packages/sequence-parallel",
        "Ulysses attention (registered all-to-all op, GQA, overlap), tiled MLP / logits loss",
        "available",
    ),
    PackageStatus(
        "deepshard-profiler",
        "deepshard.profiler",
        "packages/profiler",
        "FLOPs profiler (aten-level, per module, fwd + bwd, MFU), wall-clock breakdown",
        "available",
    ),
    PackageStatus(
        "deepshard-inference",
        "deepshard.inference",
        "packages/inference",
        "`init_inference` / `InferenceEngine` (typed config, TP through a parallelizer, "
        "safetensors checkpoints), static KV cache, continuous batching",
        "available",
    ),
    PackageStatus(
        "deepshard-launcher",
        "deepshard.launcher",
        "packages/launcher",
        "the `ds-launch` CLI (local, ssh, pdsh, SLURM, Open MPI, torchrun)",
        "available",
    ),
    PackageStatus(
        "deepshard",
        "deepshard.engine",
        "packages/deepshard",
        "meta-package: depends on every package; `initialize` and the training engine "
        "(ZeRO 0-2, fp16/bf16)",
        "available",
    ),
    PackageStatus(
        "deepshard-testing",
        "deepshard.testing",
        "packages/testing",
        "test-only: `run_on_mesh` on N gloo ranks, fake meshes",
        "available",
    ),
)
"""Every distribution, in the architecture's order."""
