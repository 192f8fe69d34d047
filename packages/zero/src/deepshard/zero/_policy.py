"""`ZeroPolicy`: how `deepshard.zero.shard` cuts a model into units and moves their parameters.

A *unit* is a submodule whose parameters are gathered and released together (one all-gather,
one reduce-scatter). The default rule follows what a model says about itself: Hugging Face
models list the classes that must never be split across devices in ``_no_split_modules``
(``LlamaDecoderLayer``...), and those are exactly the blocks worth gathering as one; a model
without that attribute gets one unit per direct child of each ``nn.ModuleList``. ``unit_classes``
or ``unit_rule`` override it. Whatever no unit owns belongs to the root unit (the module given
to ``shard``), which stays gathered.

The other fields are DeepSpeed's stage-3 knobs, in elements, and the mixed-precision part;
`ZeroPolicy.from_config` reads them from the ``zero_optimization`` section.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deepshard.interface.config import AioConfig, ZeroConfig
from deepshard.interface.errors import ConfigError
from deepshard.zero._param_offload import ParamOffload
from deepshard.zero.reduction import GradientReduction

__all__ = ["UnitRule", "ZeroPolicy"]

UnitRule = Callable[[str, torch.nn.Module], bool]
"""``(qualified name, module) -> bool``: whether that submodule is a unit of its own."""


@dataclass(frozen=True)
class ZeroPolicy:
    """What `deepshard.zero.shard` partitions and how it gathers, releases and reduces.

    Attributes:
        stage: ``stage``: 3 partitions the parameters (units gathered and released around
            their use); 0-2 keep every unit resident, its flat layout cut into buckets of
            ``reduce_bucket_size`` for gradient reduction (`deepshard.zero._resident`).
        unit_classes: Module classes each of whose instances is a unit; empty means the
            default rule (``_no_split_modules`` class names, else ``ModuleList`` children).
        unit_rule: A predicate on ``(name, module)`` choosing the units; wins over
            ``unit_classes``.
        prefetch_bucket_size: ``stage3_prefetch_bucket_size``: most parameter elements
            gathered ahead of use along the recorded execution order; 0 turns prefetch off.
        max_live_parameters: ``stage3_max_live_parameters``: most gathered elements of
            non-resident units at once (units in use are never released to honour it).
        max_reuse_distance: ``stage3_max_reuse_distance``: a unit used again within this many
            gathered elements (by the recorded order) stays gathered after its forward.
        param_persistence_threshold: ``stage3_param_persistence_threshold``: a unit of at most
            this many elements stays gathered (re-gathered once after each optimizer step).
        model_persistence_threshold: ``stage3_model_persistence_threshold``: most elements
            the units kept gathered by ``param_persistence_threshold`` may hold together
            (DeepSpeed's cap on unpartitioned parameters); units are taken in registration
            order while they fit, as DeepSpeed takes parameters. The root is not counted: it
            stays gathered whatever the thresholds.
        reduce_bucket_size: ``reduce_bucket_size``: most elements of one gradient
            reduce-scatter; a larger unit is reduced in several calls (stages 0-2: its layout
            is cut into buckets of whole parameters of at most this size; at most 4M elements
            on CPU).
        allgather_bucket_size: ``allgather_bucket_size``: most elements of one all-gather of
            updated parameters after a step at stages 1-2 (at most 4M on CPU).
        overlap_comm: ``overlap_comm``: reduce-scatters run asynchronously, at most two in
            flight; else each finishes before backward goes on.
        param_dtype: Dtype the partitions and gathered parameters are held in; ``None`` keeps
            the model's.
        grad_accum_dtype: Dtype of each rank's gradient partition across micro-steps; ``None``
            uses the parameters' dtype (as stages 0-2).
        reduction: How gradients are combined (``gradient_allreduce_op``, pre-/post-division);
            its ``dtype`` is the reduce dtype (``communication_data_type``).
        ignore_unused_parameters: A parameter without a gradient in a backward pass counts as
            zero; false makes it an error.
        param_offload: ``offload_param``: keep the partitions in host buffers or NVMe files
            between uses; ``None`` keeps them on the device.
    """

    stage: int = 3
    unit_classes: tuple[type[torch.nn.Module], ...] = ()
    unit_rule: UnitRule | None = None
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = sys.maxsize
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    param_dtype: torch.dtype | None = None
    grad_accum_dtype: torch.dtype | None = None
    reduction: GradientReduction = field(default_factory=GradientReduction)
    ignore_unused_parameters: bool = True
    param_offload: ParamOffload | None = None

    def __post_init__(self) -> None:
        sizes = {
            "stage3_prefetch_bucket_size": self.prefetch_bucket_size,
            "stage3_max_live_parameters": self.max_live_parameters,
            "stage3_max_reuse_distance": self.max_reuse_distance,
            "stage3_param_persistence_threshold": self.param_persistence_threshold,
            "stage3_model_persistence_threshold": self.model_persistence_threshold,
        }
        problems = [
            (key, f"must be >= 0, got {value}") for key, value in sizes.items() if value < 0
        ]
        if self.stage not in (0, 1, 2, 3):
            problems.append(("stage", f"must be 0, 1, 2 or 3, got {self.stage}"))
        if self.reduce_bucket_size < 1:
            problems.append(("reduce_bucket_size", f"must be > 0, got {self.reduce_bucket_size}"))
        if self.allgather_bucket_size < 1:
            size = self.allgather_bucket_size
            problems.append(("allgather_bucket_size", f"must be > 0, got {size}"))
        if self.param_offload is not None and self.stage != 3:
            problems.append(
                ("offload_param", f"needs stage 3 (parameters are whole at stage {self.stage})")
            )
        bad = [c for c in self.unit_classes if not issubclass(c, torch.nn.Module)]
        if bad:
            problems.append(("unit_classes", f"must be nn.Module subclasses, got {bad}"))
        if problems:
            raise ConfigError.from_problems(
                [(f"zero_optimization.{key}", message) for key, message in problems]
            )

    @classmethod
    def from_config(
        cls,
        zero: ZeroConfig,
        *,
        reduction: GradientReduction | None = None,
        grad_accum_dtype: torch.dtype | None = None,
        unit_classes: tuple[type[torch.nn.Module], ...] = (),
        unit_rule: UnitRule | None = None,
        aio: AioConfig | None = None,
    ) -> ZeroPolicy:
        """The policy of a ``zero_optimization`` section (DeepSpeed's key names).

        Args:
            zero: The section; its stage-3 knobs, ``reduce_bucket_size``, ``overlap_comm`` and
                ``ignore_unused_parameters`` are read.
            reduction: The top-level reduction settings (`GradientReduction.from_names`).
            grad_accum_dtype: ``data_types.grad_accum_dtype``.
            unit_classes: As the field.
            unit_rule: As the field.
            aio: The top-level ``aio`` section (NVMe parameter offload).
        """
        return cls(
            stage=zero.stage,
            unit_classes=unit_classes,
            unit_rule=unit_rule,
            prefetch_bucket_size=zero.prefetch_bucket_size,
            max_live_parameters=zero.max_live_parameters,
            max_reuse_distance=zero.max_reuse_distance,
            param_persistence_threshold=zero.param_persistence_threshold,
            model_persistence_threshold=zero.model_persistence_threshold,
            reduce_bucket_size=zero.reduce_bucket_size,
            allgather_bucket_size=zero.allgather_bucket_size,
            overlap_comm=zero.overlap_comm,
            grad_accum_dtype=grad_accum_dtype,
            reduction=reduction if reduction is not None else GradientReduction(),
            ignore_unused_parameters=zero.ignore_unused_parameters,
            param_offload=ParamOffload.from_config(zero.offload_param, aio),
        )

    def resident_units(self, numels: Sequence[int]) -> frozenset[int]:
        """Indices of the units that stay gathered, given each unit's elements (root first):
        the root, then each unit of at most ``param_persistence_threshold`` elements while the
        total stays within ``model_persistence_threshold``."""
        resident, total = {0}, 0
        for index, numel in enumerate(numels):
            if index == 0 or numel > self.param_persistence_threshold:
                continue
            if total + numel > self.model_persistence_threshold:
                continue  # a smaller unit later may still fit, as in DeepSpeed
            resident.add(index)
            total += numel
        return frozenset(resident)

    def is_unit(self, name: str, module: torch.nn.Module, *, default: bool) -> bool:
        """Whether ``module`` (at ``name``) is a unit; ``default`` is the default rule's answer."""
        if self.unit_rule is not None:
            return bool(self.unit_rule(name, module))
        if self.unit_classes:
            return isinstance(module, self.unit_classes)
        return default
