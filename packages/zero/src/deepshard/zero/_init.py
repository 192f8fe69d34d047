"""`Init`: build a model directly partitioned for ZeRO stage 3 — no rank ever holds all of it.

*When a parameter is partitioned.* Inside the block two of torch's module-registration hooks
are installed (``register_module_parameter_registration_hook`` and
``register_module_module_registration_hook``; both are removed on exit, so no global state
outlives the block). They only say *that* something was built; a module is *finished* once its
``__init__`` has returned, i.e. when no frame on the call stack is an ``__init__`` of it (the
stack is read, nothing is patched). At every registration, every tracked module that is
finished gets its parameters partitioned (`deepshard.zero._init_slices`): its weight
initialisation has run exactly as without ``Init``, so the same seed gives the same full
weights, and at most the modules still being built (and the one just finished) are whole at
once — a child is partitioned when its parent registers it or the next module starts, before
the parent's ``__init__`` ends. Like DeepSpeed's ``zero.Init``, code that changes a finished
child's weights afterwards (a parent re-initialising them) must do so inside
`GatheredParameters` with ``modifier_rank``.

*Exit.* The modules built in the block that no other one contains are the roots. Each becomes
a `ShardedModule` (`deepshard.zero._shard.build_sharded`) with the policy of ``config`` (or
``policy``): the units are planned from the full shapes, then made whole and cut into their
flat partitions one unit at a time. Parameters whose roots were dropped are made whole again.
`deepshard.zero.sharded_module_of` finds the result from the model, and ``initialize`` uses it
instead of sharding again.

*NVMe.* With ``offload_param: {device: nvme}`` (or ``remote_device="nvme"``) the slices are
written into files of a swapper of the block's own (a ``zero3-init-pid…`` directory under
``nvme_path``) as they are cut, so the finished part of the model lives only in files from
construction on; at exit each unit's parameters are read back, made whole and handed to its
NVMe home (`deepshard.zero._param_offload.NvmeHome`), and the block's files are removed.
"""

from __future__ import annotations

import os
import sys
import weakref
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from deepshard.comm import CommsLogger, ParallelDims
from deepshard.interface import DeepShardConfig, PlacementRegistry
from deepshard.interface.errors import ConfigError
from deepshard.zero._init_settings import InitSettings, resolve_init_settings
from deepshard.zero._init_slices import InitSlices
from deepshard.zero._lookup import owner_or_slices
from deepshard.zero._policy import ZeroPolicy
from deepshard.zero._shard import build_sharded, sharded_module_of
from deepshard.zero._sharded import ShardedModule
from deepshard.zero._swap import Swapper

__all__ = ["Init"]


def _modules_being_built() -> set[int]:
    """Ids of the modules whose ``__init__`` is running (some frame on the stack)."""
    active: set[int] = set()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_argcount > 0:
            first = frame.f_locals.get(code.co_varnames[0])
            if isinstance(first, torch.nn.Module):
                active.add(id(first))
        frame = frame.f_back
    return active


class _Shape:
    """A parameter's full shape and dtype, as `PlacementRegistry.replicated` reads them."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype


class Init:
    """A block under which models are built partitioned (DeepSpeed's ``zero.Init``).

    ``with Init(mesh=dims): model = Net()`` — every rank builds the model the same way.

    Args:
        config: A DeepSpeed-style config (path, dict or `DeepShardConfig`) at stage 3: its
            ``zero_optimization`` section makes the policy, its precision sections the dtype.
        mesh: A `deepshard.comm.ParallelDims` or DeepShard mesh; ``None`` builds one over the
            world (which must exist).
        dtype: Cast floating parameters to it while partitioning; ``None``: the config's, or
            keep theirs.
        remote_device: ``"cpu"`` keeps partitions (and the gathered units) on the host;
            ``"nvme"`` keeps the partitions in files under ``offload_param.nvme_path`` from
            construction on (the config's or policy's ``offload_param`` must be NVMe);
            ``None`` follows ``offload_param`` (the mesh's device without one).
        enabled: ``False`` makes the block (and ``module``) do nothing.
        module: An existing model to partition now (the result is in `sharded`).
        policy: Instead of the config's, the units and knobs (``unit_classes`` ...).
        comms_logger: Records every collective of the sharded models.
        config_dict_or_path: DeepSpeed's keyword for ``config`` (``zero.Init(
            config_dict_or_path=ds_config)``, as the HF integration writes it).

    Raises:
        ConfigError: As `deepshard.zero._init_settings.resolve_init_settings`: a bad
            ``remote_device`` (``"nvme"`` without an NVMe ``offload_param``), a config not at
            stage 3, no mesh and no world; an ``nvme_path`` that is not a writable directory;
            both ``config`` and ``config_dict_or_path``.
    """

    def __init__(
        self,
        config: DeepShardConfig | dict[str, Any] | str | Path | None = None,
        mesh: DeviceMesh | ParallelDims | None = None,
        dtype: torch.dtype | None = None,
        remote_device: str | None = None,
        enabled: bool = True,
        module: torch.nn.Module | None = None,
        *,
        policy: ZeroPolicy | None = None,
        comms_logger: CommsLogger | None = None,
        config_dict_or_path: DeepShardConfig | dict[str, Any] | str | Path | None = None,
    ) -> None:
        if config_dict_or_path is not None:
            if config is not None:
                raise ConfigError(
                    "Init: config and config_dict_or_path (DeepSpeed's name for it) are both "
                    "given; pass one"
                )
            config = config_dict_or_path
        self.enabled = enabled
        self.sharded: list[ShardedModule] = []
        """The sharded models this block built, in order."""
        self._logger = comms_logger
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._slices: InitSlices | None = None
        self._built: list[weakref.ref[torch.nn.Module]] = []
        self._unfinished: list[weakref.ref[torch.nn.Module]] = []
        self._tracked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        if not enabled:
            return
        self.settings: InitSettings = resolve_init_settings(
            config, mesh, dtype, remote_device, policy
        )
        if module is not None:
            self._move(module, None)
            self.sharded.append(self._shard(module, None))

    # --- the block --------------------------------------------------------------------

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if self._slices is not None:
            raise ConfigError("Init: this block is already open; use a new Init for a new block")
        s = self.settings
        files = None
        if s.slice_files is not None:
            assert s.slice_files.nvme_path is not None, "the schema requires nvme_path with nvme"
            files = Swapper(
                s.slice_files.nvme_path,
                s.slice_files.aio,
                prefix=f"zero3-init-pid{os.getpid()}-",
                key="zero_optimization.offload_param.nvme_path",
            )
        self._slices = InitSlices(
            s.group, dtype=s.dtype, device=s.device, logger=self._logger, files=files
        )
        self._handles = [
            register_module_parameter_registration_hook(self._on_parameter),
            register_module_module_registration_hook(self._on_module),
        ]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        slices, self._slices = self._slices, None
        if slices is None:
            return
        try:
            if exc_type is None:  # no collective after a rank's failure
                self._partition_finished(slices)
                for root in self._roots():
                    self._move(root, slices)
                    self.sharded.append(self._shard(root, slices))
                slices.materialize(slices.params())  # parameters no root holds: whole again
        finally:
            slices.close()

    def partition_bytes(self) -> int:
        """Bytes of this rank's partitions of the parameters built so far in the open block."""
        return self._slices.partition_bytes() if self._slices is not None else 0

    # --- registration hooks -----------------------------------------------------------

    def _track(self, module: torch.nn.Module) -> None:
        if module not in self._tracked:
            self._tracked.add(module)
            self._built.append(weakref.ref(module))
            self._unfinished.append(weakref.ref(module))

    def _on_parameter(self, module: torch.nn.Module, name: str, param: Any) -> None:
        self._track(module)
        self._partition_finished(self._slices)

    def _on_module(self, parent: torch.nn.Module, name: str, child: Any) -> None:
        self._track(parent)
        if isinstance(child, torch.nn.Module):
            self._track(child)
        self._partition_finished(self._slices)

    def _partition_finished(self, slices: InitSlices | None) -> None:
        """Partition the parameters of every tracked module whose ``__init__`` returned."""
        if slices is None:
            return
        active = _modules_being_built()
        still: list[weakref.ref[torch.nn.Module]] = []
        for ref in self._unfinished:
            module = ref()
            if module is None:
                continue
            if id(module) in active:
                still.append(ref)
                continue
            for param in module.parameters():
                if not slices.holds(param) and not _owned(param):
                    slices.partition(param)
        self._unfinished = still

    # --- exit ---------------------------------------------------------------------------

    def _roots(self) -> list[torch.nn.Module]:
        """Modules built in the block, alive, with parameters, that no other one contains."""
        alive = [m for m in (ref() for ref in self._built) if m is not None]
        inner = {id(sub) for m in alive for sub in m.modules() if sub is not m}
        roots = [m for m in alive if id(m) not in inner and any(True for _ in m.parameters())]
        for root in roots:
            if any(sharded_module_of(m) is not None for m in root.modules()):
                raise ConfigError(
                    f"Init: {type(root).__name__} built in the block contains a module that is "
                    "already sharded; build it from unsharded modules"
                )
        return roots

    def _move(self, module: torch.nn.Module, slices: InitSlices | None) -> None:
        """Cast and move the parameters not partitioned yet (built outside the block)."""
        s = self.settings
        for param in module.parameters():
            if slices is not None and slices.holds(param):
                continue
            dtype = s.dtype if s.dtype is not None and param.is_floating_point() else param.dtype
            param.data = param.data.to(device=s.device, dtype=dtype)
        for buffer in module.buffers():
            buffer.data = buffer.data.to(s.device)

    def _shard(self, module: torch.nn.Module, slices: InitSlices | None) -> ShardedModule:
        if any(sharded_module_of(m) is not None for m in module.modules()):
            raise ConfigError(
                f"Init(module=): {type(module).__name__} is already sharded (ZeRO stage 3)"
            )
        shapes = slices.full_shapes() if slices is not None else {}
        named = [
            (name, _Shape(shapes.get(id(p), tuple(p.shape)), p.dtype))
            for name, p in module.named_parameters()
        ]
        placements = PlacementRegistry.replicated(named, self.settings.topology)
        s = self.settings
        return build_sharded(module, s.group, s.policy, placements, self._logger, source=slices)


def _owned(param: torch.Tensor) -> bool:
    """Whether a ShardedModule or another open Init block partitioned ``param`` already."""
    try:
        owner_or_slices(param, argument="param")
    except ConfigError:
        return False
    return True
