"""ZeRO stages 0-3: partitioned optimizer state, master weights, gradients and parameters.

Stage 3 is two verbs: `shard` partitions a model's parameters (the model side, a
`ShardedModule`), and ``ZeroOptimizer(inner, sharded_module)`` steps the partitions. `Init`
builds a model partitioned from the start; `GatheredParameters` and `partition` make stage-3
parameters whole by hand and write them back; `Repartition` swaps parameters of an Init-built
model block by block (AutoEP's experts) and shards it anew.

`offload_saved_tensors` moves the activations autograd saves to host memory until backward.

`ZeroOptimizer` wraps any element-wise ``torch.optim.Optimizer`` (`build_zero_optimizer` builds
it from a DeepSpeed config), and Muon through a `FullGradTransform` of whole gradients; the
functional core (flat layout and partitioning, bucket planning, gradient arithmetic, norms) is
importable on its own and needs no process group. ``ZeroOptimizer.offload_states`` /
``reload_states`` move its states to host memory and back; the ``safe_get_*`` / ``safe_set_*``
functions (`deepshard.zero.access`) read and write one parameter's master, gradient and state.
"""

from deepshard.zero._full_grads import FullGradTransform
from deepshard.zero._gather_waits import GatherWaits
from deepshard.zero._gathered import GatheredParameters, partition
from deepshard.zero._init import Init
from deepshard.zero._init_settings import stage3_policy, zero_policy
from deepshard.zero._optimizer_check import ZERO_SAFE_ATTRIBUTE, is_zero_safe
from deepshard.zero._policy import ZeroPolicy
from deepshard.zero._repartition import Repartition
from deepshard.zero._resident import ResidentModule
from deepshard.zero._settings import zero_problems
from deepshard.zero._shard import register_external_parameter, shard, shard_info, sharded_module_of
from deepshard.zero._shard_info import ShardInfo
from deepshard.zero._sharded import ShardedModule
from deepshard.zero._stage3_optimizer import Stage3Optimizer
from deepshard.zero._state_shards import StateShard
from deepshard.zero._states import OFFLOAD_STATE_TYPES, OffloadReport
from deepshard.zero.access import (
    PartitionedOwner,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)
from deepshard.zero.build import build_zero_optimizer, optimizer_side_problems
from deepshard.zero.layout import (
    ALIGNMENT_BYTES,
    Bucket,
    FlatLayout,
    GatherCall,
    ParamSlot,
    Piece,
    gather_copies,
    plan_flat_layout,
    plan_gather_calls,
)
from deepshard.zero.norms import GradNorm, global_grad_norm, grad_overflow, scale_factor
from deepshard.zero.optimizer import ParamShard, StepResult, ZeroOptimizer
from deepshard.zero.reduction import GradientReduction, PendingReduction, reduce_bucket, torch_dtype
from deepshard.zero.saved_tensors import OffloadStats, SavedTensorOffload, offload_saved_tensors

__all__ = [
    "ALIGNMENT_BYTES",
    "OFFLOAD_STATE_TYPES",
    "ZERO_SAFE_ATTRIBUTE",
    "Bucket",
    "FlatLayout",
    "FullGradTransform",
    "GatherCall",
    "GatherWaits",
    "GatheredParameters",
    "GradNorm",
    "GradientReduction",
    "Init",
    "OffloadReport",
    "OffloadStats",
    "ParamShard",
    "ParamSlot",
    "PartitionedOwner",
    "PendingReduction",
    "Piece",
    "Repartition",
    "ResidentModule",
    "SavedTensorOffload",
    "ShardInfo",
    "ShardedModule",
    "Stage3Optimizer",
    "StateShard",
    "StepResult",
    "ZeroOptimizer",
    "ZeroPolicy",
    "build_zero_optimizer",
    "gather_copies",
    "global_grad_norm",
    "grad_overflow",
    "is_zero_safe",
    "offload_saved_tensors",
    "optimizer_side_problems",
    "partition",
    "plan_flat_layout",
    "plan_gather_calls",
    "reduce_bucket",
    "register_external_parameter",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "scale_factor",
    "shard",
    "shard_info",
    "sharded_module_of",
    "stage3_policy",
    "torch_dtype",
    "zero_policy",
    "zero_problems",
]
