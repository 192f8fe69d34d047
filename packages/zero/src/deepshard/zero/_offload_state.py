"""Where offloaded masters and Adam moments live between steps: host buffers or NVMe files.

Both stores hand out one sub-group at a time (`acquire`), as ``(master, exp_avg, exp_avg_sq)``
host tensors the CPU Adam kernel updates in place, and take it back (`release`).

* `HostState` (``device: "cpu"``): every partition resident in host buffers; acquiring is
  slicing.
* `NvmeState` (``device: "nvme"``): one file per (param group, state) under the swapper's
  directory, the sub-group at its byte offset, and a ring of host *slots*, each holding one
  sub-group's three tensors. With ``pipeline_read`` the next sub-group is read into the next
  slot while this one steps; with ``pipeline_write`` a stepped sub-group's write is left in
  flight and waited for only when its slot comes round again. The ring therefore has
  ``1 + pipeline_read + pipeline_write`` slots, 3 swap buffers each (fp32 master and two
  moments); ``buffer_count`` must allow at least one slot. The moments of a sub-group never
  written are zero in memory, not read, so the files need no zero-filling at start-up (which is
  what ``fast_init`` would skip).

Host buffers come from `host_allocator`: the accelerator's ``pin_empty`` (page-locked, allocated
pinned directly) with ``pin_memory``, plain host memory otherwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from deepshard.interface.accelerator import Accelerator
from deepshard.interface.config import AioConfig, OffloadOptimizerConfig
from deepshard.interface.errors import ConfigError
from deepshard.zero._offload_plan import SubGroup
from deepshard.zero._swap import Swapper, SwapRequest

__all__ = ["STATE_NAMES", "Allocate", "HostState", "NvmeState", "host_allocator"]

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
"""The per-sub-group tensors an offloaded Adam step reads and writes."""

Allocate = Callable[[int, torch.dtype], torch.Tensor]
"""``(numel, dtype) ->`` an uninitialised 1-D host tensor."""

Acquired = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def host_allocator(
    accelerator: Accelerator,
    pin_memory: bool,
    *,
    key: str = "zero_optimization.offload_optimizer",
) -> Allocate:
    """Host buffers through ``accelerator.pin_empty`` (``pin_memory``) or plain ``torch.empty``.

    Where a device accelerator cannot pin, a `UserWarning` names the key and training goes on
    with pageable buffers (only the copies' overlap is lost); on the CPU accelerator the host is
    the device, so there is nothing to pin and nothing to warn about.
    """
    if not pin_memory:
        return lambda numel, dtype: torch.empty(numel, dtype=dtype, device="cpu")
    if accelerator.name != "cpu" and not accelerator.pin_empty(1, dtype=torch.uint8).is_pinned():
        warnings.warn(
            f"{key}.pin_memory: the {accelerator.name} accelerator "
            "cannot page-lock host memory, so offload copies are synchronous; set pin_memory "
            "to false to silence this",
            UserWarning,
            stacklevel=4,
        )
    return lambda numel, dtype: accelerator.pin_empty(numel, dtype=dtype)


class HostState:
    """Masters (and moments) of every sub-group resident in host buffers.

    Args:
        masters: This rank's fp32 master partition of every group, in host buffers.
        moment_dtype: The moments' dtype; ``None`` keeps no moments (the inner optimizer
            holds its own state).
        allocate: Makes the moment buffers.
    """

    def __init__(
        self, masters: list[torch.Tensor], moment_dtype: torch.dtype | None, allocate: Allocate
    ) -> None:
        self.masters = masters
        self.moments: list[list[torch.Tensor]] = []
        if moment_dtype is not None:
            for _ in range(2):
                self.moments.append([allocate(m.numel(), moment_dtype).zero_() for m in masters])

    def prefetch(self, sub: SubGroup) -> None:
        """Nothing to fetch: everything is resident."""

    def acquire(self, sub: SubGroup) -> Acquired:
        """The sub-group's master and moments (views of the resident buffers)."""
        master = self.masters[sub.group][sub.start : sub.stop]
        if not self.moments:
            return master, None, None
        m, v = (moments[sub.group][sub.start : sub.stop] for moments in self.moments)
        return master, m, v

    def release(self, sub: SubGroup) -> None:
        """Nothing to write back."""

    def finish(self) -> None:
        """Nothing in flight."""

    def whole(self) -> list[list[torch.Tensor]]:
        """Per state name (`STATE_NAMES`, masters only without moments), every group's tensor."""
        return [self.masters, *self.moments]

    def load(self, states: Sequence[Sequence[torch.Tensor]]) -> None:
        """Copy whole partitions (as `whole` returns them) in."""
        for mine, saved in zip(self.whole(), states, strict=True):
            for dst, src in zip(mine, saved, strict=True):
                dst.copy_(src)

    def close(self) -> None:
        """Host buffers are freed with the object."""


class _Slot:
    """Host buffers for one sub-group's three tensors, and the I/O pending on them."""

    def __init__(
        self, numel: int, master_dtype: torch.dtype, moment_dtype: torch.dtype, allocate: Allocate
    ) -> None:
        dtypes = (master_dtype, moment_dtype, moment_dtype)
        self.tensors = [allocate(numel, dtype) for dtype in dtypes]
        self.sub: SubGroup | None = None
        self.reads: list[SwapRequest] = []
        self.writes: list[SwapRequest] = []

    def views(self, numel: int) -> list[torch.Tensor]:
        return [t[:numel] for t in self.tensors]


class NvmeState:
    """Masters and moments of every sub-group in files, moved through a ring of host slots.

    Args:
        masters: This rank's master partition of every group (any device; fp32, or 16-bit
            masters), written to the files once and not kept.
        subs: The sub-groups.
        section: The ``offload_optimizer`` section (``nvme_path``, ``buffer_count``,
            ``pipeline_read``, ``pipeline_write``).
        aio: The ``aio`` section, for the swapper.
        moment_dtype: The moments' dtype.
        allocate: Makes the slot buffers.
        prefix: Start of the swap directory's name (unique per rank and optimizer).

    Raises:
        ConfigError: ``buffer_count`` below 3, or ``nvme_path`` not a writable directory.
    """

    def __init__(
        self,
        masters: Sequence[torch.Tensor],
        subs: Sequence[SubGroup],
        section: OffloadOptimizerConfig,
        aio: AioConfig,
        moment_dtype: torch.dtype,
        allocate: Allocate,
        *,
        prefix: str,
    ) -> None:
        if section.buffer_count < len(STATE_NAMES):
            raise ConfigError.from_problems(
                [
                    (
                        "zero_optimization.offload_optimizer.buffer_count",
                        f"must be >= {len(STATE_NAMES)} (a sub-group's fp32 master and two "
                        f"Adam moments), got {section.buffer_count}",
                    )
                ]
            )
        assert section.nvme_path is not None, "the schema requires nvme_path with nvme"
        self.swapper = Swapper(Path(section.nvme_path), aio, prefix=prefix)
        self._read_ahead, self._write_behind = section.pipeline_read, section.pipeline_write
        count = 1 + self._read_ahead + self._write_behind
        largest = max((sub.numel for sub in subs), default=0)
        self._master_dtype = masters[0].dtype if masters else torch.float32
        slot = (largest, self._master_dtype, moment_dtype, allocate)
        self._slots = [_Slot(*slot) for _ in range(count)]
        self._subs = list(subs)
        self._order = {sub: k for k, sub in enumerate(subs)}
        self._numels = [m.numel() for m in masters]
        self._moment_dtype = moment_dtype
        self._fresh = set(subs)  # moments never written: zero, not read
        for sub in subs:
            self._write(0, sub, [masters[sub.group][sub.start : sub.stop]], names=("master",))

    def file(self, group: int, name: str) -> Path:
        """The file of one state (`STATE_NAMES`) of one param group."""
        return self.swapper.path(self._name(group, name))

    @staticmethod
    def _name(group: int, name: str) -> str:
        return f"group{group}.{name}"

    def _offset(self, sub: SubGroup, name: str) -> int:
        return sub.start * self._dtype(name).itemsize

    def _dtype(self, name: str) -> torch.dtype:
        return self._master_dtype if name == "master" else self._moment_dtype

    def _write(
        self, k: int, sub: SubGroup, sources: Sequence[torch.Tensor], *, names: Sequence[str]
    ) -> None:
        slot = self._slots[k % len(self._slots)]
        self._drain(slot)
        for name, src, dst in zip(names, sources, slot.views(sub.numel), strict=False):
            dst.copy_(src)
            request = self.swapper.write(
                self._name(sub.group, name), dst, offset=self._offset(sub, name)
            )
            slot.writes.append(request)
        self._drain(slot)

    @staticmethod
    def _drain(slot: _Slot) -> None:
        for request in (*slot.reads, *slot.writes):
            request.wait()
        slot.reads, slot.writes = [], []

    def prefetch(self, sub: SubGroup) -> None:
        """Start reading ``sub`` into its slot, once the slot's earlier writes are done."""
        slot = self._slots[self._order[sub] % len(self._slots)]
        if slot.sub == sub:
            return  # read ahead already
        self._drain(slot)
        slot.sub = sub
        views = slot.views(sub.numel)
        for name, view in zip(STATE_NAMES, views, strict=True):
            if name != "master" and sub in self._fresh:
                view.zero_()
                continue
            request = self.swapper.read(
                self._name(sub.group, name), view, offset=self._offset(sub, name)
            )
            slot.reads.append(request)

    def acquire(self, sub: SubGroup) -> Acquired:
        """``sub``'s master and moments in its slot (read now unless prefetched); read ahead the
        next sub-group with ``pipeline_read``."""
        k = self._order[sub]
        self.prefetch(sub)
        slot = self._slots[k % len(self._slots)]
        for request in slot.reads:
            request.wait()
        slot.reads = []
        if self._read_ahead and k + 1 < len(self._subs):
            self.prefetch(self._subs[k + 1])
        master, m, v = slot.views(sub.numel)
        return master, m, v

    def release(self, sub: SubGroup) -> None:
        """Write ``sub``'s updated state behind (waited for now unless ``pipeline_write``)."""
        slot = self._slots[self._order[sub] % len(self._slots)]
        for name, view in zip(STATE_NAMES, slot.views(sub.numel), strict=True):
            request = self.swapper.write(
                self._name(sub.group, name), view, offset=self._offset(sub, name)
            )
            slot.writes.append(request)
        self._fresh.discard(sub)
        if not self._write_behind:
            self._drain(slot)

    def finish(self) -> None:
        """Wait for every write, so the files hold the state of the finished step."""
        for slot in self._slots:
            self._drain(slot)
            slot.sub = None

    def whole(self) -> list[list[torch.Tensor]]:
        """Per state name (`STATE_NAMES`), every group's whole partition, read from the files."""
        self.finish()
        states = []
        for name in STATE_NAMES:
            dtype = self._dtype(name)
            per_group = [torch.zeros(n, dtype=dtype) for n in self._numels]
            for sub in self._subs:
                if name == "master" or sub not in self._fresh:
                    view = per_group[sub.group][sub.start : sub.stop]
                    self.swapper.read(
                        self._name(sub.group, name), view, offset=self._offset(sub, name)
                    ).wait()
            states.append(per_group)
        return states

    def _overlapping(self, group: int, lo: int, hi: int) -> list[tuple[SubGroup, int, int]]:
        """The sub-groups of ``group`` meeting ``[lo, hi)``, with the common range."""
        found = []
        for sub in self._subs:
            a, b = max(lo, sub.start), min(hi, sub.stop)
            if sub.group == group and a < b:
                found.append((sub, a, b))
        return found

    def read_range(self, group: int, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of one state (`STATE_NAMES`) of ``group``, read from its file
        into a new host tensor (zero where no sub-group was stepped yet, or none covers)."""
        self.finish()
        dtype = self._dtype(name)
        out = torch.zeros(hi - lo, dtype=dtype)
        for sub, a, b in self._overlapping(group, lo, hi):
            if name != "master" and sub in self._fresh:
                continue
            offset = self._offset(sub, name) + (a - sub.start) * dtype.itemsize
            self.swapper.read(self._name(group, name), out[a - lo : b - lo], offset=offset).wait()
        return out

    def write_range(self, group: int, name: str, lo: int, values: torch.Tensor) -> None:
        """Write ``values`` as elements ``lo:`` of one state of ``group`` into its file.

        A sub-group whose moments were never written gets zero moments in its files first (the
        rest of its range then reads as the zeros it stood for).
        """
        self.finish()
        dtype = self._dtype(name)
        host = values.detach().to("cpu", dtype).reshape(-1).contiguous()
        for sub, a, b in self._overlapping(group, lo, lo + host.numel()):
            if name != "master" and sub in self._fresh:
                zeros = torch.zeros(sub.numel, dtype=self._moment_dtype)
                for moment in STATE_NAMES[1:]:
                    request = self.swapper.write(
                        self._name(group, moment), zeros, offset=self._offset(sub, moment)
                    )
                    request.wait()
                self._fresh.discard(sub)
            offset = self._offset(sub, name) + (a - sub.start) * dtype.itemsize
            piece = host[a - lo : b - lo]
            self.swapper.write(self._name(group, name), piece, offset=offset).wait()

    def load(self, states: Sequence[Sequence[torch.Tensor]]) -> None:
        """Write whole partitions (as `whole` returns them) into the files."""
        self.finish()
        for sub in self._subs:
            pieces = [state[sub.group][sub.start : sub.stop] for state in states]
            self._write(0, sub, pieces, names=STATE_NAMES)
            self._fresh.discard(sub)

    def close(self) -> None:
        """Remove the swap files."""
        self.swapper.close()
