"""DeepSpeed engine names that DeepShard leaves out on purpose, with what to use instead.

A DeepSpeed script ported by changing its import line may still call ``engine.train_batch()`` or
``engine.save_checkpoint(...)``. A bare ``AttributeError`` would leave its author guessing whether
the name is misspelled, renamed or gone; the engine looks every missing name up in this one table
and, for a listed one, says why it is absent and what replaces it. A name not listed (a typo) gets
Python's usual ``AttributeError``.

Two kinds of entries:

* features DeepShard does not carry, or not yet (pipeline parallelism, random-LTD,
  universal-checkpoint loaders, ...), grouped by the reason;
* DeepSpeed's one-line readers of config keys (``engine.zero_reduce_bucket_size()``): DeepShard's
  engine does not repeat its typed config as methods, so the message names the field to read
  (``engine.parts.config.zero_optimization.reduce_bucket_size``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

__all__ = ["CONFIG_READERS", "REFUSED_ENGINE_NAMES", "refused_attribute_message"]

_CHECKPOINT = (
    "DeepShard's checkpoints are universal by construction: engine.load_checkpoint(load_dir) "
    "reshards any engine checkpoint to this run's world size and ZeRO stage on load"
)
_LOAD_MODULE = (
    "loading into the engine's module would leave ZeRO's fp32 master weights behind; load the "
    "weights into the model before initialize (safetensors.torch.load_model(model, path))"
)
_PIPELINE = (
    "DeepShard has no pipeline-parallel engine (the config's pipeline section is refused); "
    "write the loop yourself: loss = engine(batch); engine.backward(loss); engine.step() once "
    "per micro-batch"
)
_DATA_POST_PROCESS = (
    "DeepShard does not carry the data post-processing hook of DeepSpeed's data-efficiency "
    "library; transform the batch in the loader's collate_fn (curriculum schedules: "
    "engine.curriculum_difficulty(metric))"
)
_EIGENVALUE = (
    "DeepShard does not carry the Hessian eigenvalue estimator or progressive layer dropping "
    "(the config refuses them); implement layer drop inside the model"
)
_SPARSE = (
    "ZeRO reduces every gradient itself, sparse ones (torch.nn.Embedding(sparse=True)) as dense "
    "(the same result); there is nothing to call"
)
_REDUCTION = (
    "ZeRO reduces gradients itself, from backward hooks at the accumulation boundary, so there "
    "is nothing to call; use engine.no_sync() or engine.set_gradient_accumulation_boundary() "
    "to choose when, or managed_gradient_accumulation: false to end each cycle at step()"
)
_COMPILE = (
    "DeepShard does not carry DeepCompile; use engine.compile(backend=...) (plain torch.compile) "
    "or pass torch.compile(model) to initialize"
)
_BATCH_SIZE = (
    "the batch sizes are fixed when initialize reconciles them with the world; build a new "
    "engine with the new train_batch_size / train_micro_batch_size_per_gpu"
)
_LOADER = (
    "initialize returns the loader it builds from training_data as its third value "
    "(engine, optimizer, loader, lr_scheduler = initialize(...)); for another dataset, build a "
    "torch DataLoader with a DistributedSampler"
)
_AMP = "DeepShard does not carry NVIDIA Apex AMP (amp is refused); use bf16, fp16 or torch_autocast"


def _mesh(expression: str) -> str:
    return f"the mesh is the one source of ranks and groups: use {expression}"


def _same(names: Iterable[str], message: str) -> dict[str, str]:
    return dict.fromkeys(names, message)


CONFIG_READERS: Mapping[str, str] = MappingProxyType(
    {
        "steps_per_print": "steps_per_print",
        "wall_clock_breakdown": "wall_clock_breakdown",
        "memory_breakdown": "memory_breakdown",
        "dump_state": "dump_state",
        "dataloader_drop_last": "dataloader_drop_last",
        "sparse_gradients_enabled": "sparse_gradients",
        "zero_allow_untested_optimizer": "zero_allow_untested_optimizer",
        "communication_data_type": "communication_data_type",
        "gradient_predivide_factor": "gradient_predivide_factor",
        "log_level": "log_level",
        "optimizer_name": "optimizer.type",
        "optimizer_params": "optimizer.params",
        "scheduler_name": "scheduler.type",
        "scheduler_params": "scheduler.params",
        "fp16_auto_cast": "fp16.auto_cast",
        "torch_autocast_enabled": "torch_autocast.enabled",
        "torch_autocast_dtype": "torch_autocast.dtype",
        "zero_optimization": "zero_optimization",
        "zero_reduce_bucket_size": "zero_optimization.reduce_bucket_size",
        "zero_allgather_bucket_size": "zero_optimization.allgather_bucket_size",
        "zero_overlap_comm": "zero_optimization.overlap_comm",
        "zero_contiguous_gradients": "zero_optimization.contiguous_gradients",
        "zero_reduce_scatter": "zero_optimization.reduce_scatter",
        "zero_compute_grad_norm": "zero_optimization.compute_grad_norm",
        "zero_offload_optimizer": "zero_optimization.offload_optimizer",
        "zero_offload_param": "zero_optimization.offload_param",
        "zero_sub_group_size": "zero_optimization.sub_group_size",
        "zero_ignore_unused_parameters": "zero_optimization.ignore_unused_parameters",
        "zero_hpz_partition_size": "zero_optimization.zero_hpz_partition_size",
        "zero_gather_16bit_weights_on_model_save": (
            "zero_optimization.gather_16bit_weights_on_model_save"
        ),
        "tensor_parallel_config": "tensor_parallel",
        "autotp_size": "tensor_parallel.autotp_size",
        "elasticity_enabled": "elasticity.enabled",
        "curriculum_params_legacy": "curriculum_learning",
        "curriculum_learning_config": "data_efficiency.data_sampling.curriculum_learning",
        "data_efficiency_enabled": "data_efficiency.enabled",
        "data_efficiency_config": "data_efficiency",
        "data_sampling_enabled": "data_efficiency.data_sampling.enabled",
        "data_sampling_config": "data_efficiency.data_sampling",
    }
)
"""DeepSpeed's config-reading engine methods, by name, with the config field each one reads
(an attribute path on `DeepShardConfig`)."""

_FEATURES: dict[str, str] = {
    **_same(
        ("load_universal_checkpoint", "load_moe_state_dict"),
        _CHECKPOINT,
    ),
    "load_module_state_dict": _LOAD_MODULE,
    "save_fp16_model": "DeepSpeed's deprecated name; call engine.save_16bit_model(save_dir)",
    **_same(
        (
            "train_batch",
            "eval_batch",
            "is_first_stage",
            "is_last_stage",
            "set_dataiterator",
            "set_batch_fn",
            "get_pipeline_parallel_rank",
            "set_has_attention_mask",
            "reset_activation_shape",
        ),
        _PIPELINE,
    ),
    **_same(("set_data_post_process_func",), _DATA_POST_PROCESS),
    **_same(
        (
            "eigenvalue_enabled",
            "eigenvalue_verbose",
            "eigenvalue_max_iter",
            "eigenvalue_tol",
            "eigenvalue_stability",
            "eigenvalue_gas_boundary_resolution",
            "eigenvalue_layer_name",
            "eigenvalue_layer_num",
            "pld_enabled",
            "pld_params",
            "pld_theta",
            "pld_gamma",
            "get_pld_theta",
        ),
        _EIGENVALUE,
    ),
    **_same(
        ("sparse_allreduce", "sparse_allreduce_bucket", "sparse_allreduce_no_retain"),
        _SPARSE,
    ),
    "sparse_all_gather": _SPARSE,
    **_same(
        (
            "allreduce_gradients",
            "allreduce_bucket",
            "allreduce_and_copy",
            "allreduce_no_retain",
            "buffered_allreduce_fallback",
            "clip_fp32_gradients",
        ),
        _REDUCTION,
    ),
    **_same(
        (
            "get_compile_time",
            "register_compile_pass",
            "is_deepcompile_enabled",
            "is_deepcompile_active",
            "get_deepcompile_backend",
        ),
        _COMPILE,
    ),
    **_same(("set_train_batch_size", "set_train_micro_batch_size"), _BATCH_SIZE),
    "deepspeed_io": _LOADER,
    **_same(("amp_enabled", "amp_params"), _AMP),
    "get_data_parallel_rank": _mesh("engine.mesh['dp'].get_local_rank()"),
    "get_tensor_parallel_rank": _mesh("engine.mesh['tp'].get_local_rank()"),
    "get_model_parallel_rank": _mesh("engine.mesh['tp'].get_local_rank()"),
    "get_sequence_parallel_group": _mesh("engine.mesh['sp'].get_group()"),
    "dp_world_size": _mesh("engine.mesh['dp'].size()"),
    "mp_world_size": _mesh("engine.mesh['tp'].size()"),
    "get_batch_info": "use engine.train_batch_size(), engine.train_micro_batch_size_per_gpu() "
    "and engine.gradient_accumulation_steps()",
    "empty_partition_cache": "only ZeRO-3 keeps a parameter cache, and this release runs "
    "stages 0-2, which gather nothing between steps; remove the call",
}

REFUSED_ENGINE_NAMES: Mapping[str, str] = MappingProxyType(
    {
        **_FEATURES,
        **{
            name: "DeepShard's engine does not repeat its config as methods; read "
            f"engine.parts.config.{path}"
            for name, path in CONFIG_READERS.items()
        },
    }
)
"""Every DeepSpeed engine name DeepShard leaves out on purpose, with the reason and the
replacement."""


def refused_attribute_message(owner: str, name: str) -> str | None:
    """The ``AttributeError`` message for a DeepSpeed name DeepShard leaves out, or None.

    Args:
        owner: The class name, as Python's own message gives it.
        name: The attribute looked up.

    Returns:
        ``"'<owner>' object has no attribute '<name>': <why and what instead>"``, or None when
        ``name`` is not in `REFUSED_ENGINE_NAMES`.
    """
    reason = REFUSED_ENGINE_NAMES.get(name)
    if reason is None:
        return None
    return f"{owner!r} object has no attribute {name!r}: {reason}"
