"""What an open `deepshard.zero.Init` block holds: this rank's slice of each parameter so far.

A parameter is partitioned on its own as soon as the module that made it is finished: flattened,
cut into ``W`` equal slices of ``ceil(numel / W)`` elements (the last one zero-padded), rank
``r`` keeps slice ``r`` (cast and moved as the block says) and the parameter's ``.data``
becomes an empty tensor. Nothing is communicated while the model is built. When the block
exits, `deepshard.zero._shard.build_sharded` asks for one unit's parameters at a time
(`InitSlices.materialize`): one all-gather per parameter makes it whole again for as long as
its unit takes to keep its own chunk. `GatheredParameters` on a parameter of a block still open
gathers it the same way and re-slices it on exit.

With NVMe parameter offload (``Init(remote_device="nvme")`` or ``offload_param: {device:
nvme}``) the slices live in files from the moment they are cut: each is written into its own
file of the block's `Swapper` (``slice{n}``, ``ceil(numel / W)`` elements) and the kept tensor
holds no bytes; making a parameter whole reads its slice back into a fresh host tensor first,
and a `GatheredParameters` change is written back into the file. So while the model is built
the host holds at most the modules being built, never the finished slices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepshard.comm import CommsLogger, all_gather_into_tensor, broadcast
from deepshard.zero._sharded import register_param_hook
from deepshard.zero._swap import Swapper

__all__ = ["InitSlices", "SliceHook"]


class SliceHook:
    """ZeRO's hook object on a parameter an open `Init` partitioned; it names the store.

    It never fires (a partitioned parameter takes part in no backward pass inside the block).
    """

    def __init__(self, slices: InitSlices) -> None:
        self.slices = slices

    def __call__(self, param: torch.Tensor) -> None:
        return None


@dataclass
class _Held:
    """One partitioned parameter."""

    param: torch.nn.Parameter
    shape: tuple[int, ...]
    piece: torch.Tensor
    """This rank's slice (``ceil(numel / W)`` elements); no bytes when it is in a file."""
    handle: torch.utils.hooks.RemovableHandle
    gathered: int = 0
    """Open `GatheredParameters` blocks holding it whole."""

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class InitSlices:
    """This rank's slices of the parameters an open `Init` block partitioned, in order.

    Args:
        group: The data-parallel group.
        dtype: Cast floating parameters to it; ``None`` keeps theirs.
        device: Where the slices live.
        logger: Records the all-gathers and broadcasts.
        files: Keep the slices in files of this swapper (NVMe) instead of memory.
    """

    def __init__(
        self,
        group: torch.distributed.ProcessGroup,
        *,
        dtype: torch.dtype | None,
        device: torch.device,
        logger: CommsLogger | None,
        files: Swapper | None = None,
    ) -> None:
        self.group, self.dtype, self.device, self._logger = group, dtype, device, logger
        self.rank, self.world = group.rank(), group.size()
        self.files = files
        self._held: dict[int, _Held] = {}
        self._names: dict[int, str] = {}

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is partitioned here."""
        return id(param) in self._held

    def params(self) -> list[torch.nn.Parameter]:
        """Every parameter still partitioned here, in the order they were partitioned."""
        return [held.param for held in self._held.values()]

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        """The full shape of every parameter held, by ``id``."""
        return {key: held.shape for key, held in self._held.items()}

    def partition_bytes(self) -> int:
        """Bytes of this rank's slices held in memory (none when they are in files)."""
        return sum(h.piece.untyped_storage().nbytes() for h in self._held.values())

    def _store(self, param: torch.nn.Parameter, piece: torch.Tensor) -> None:
        """Write ``piece`` (a host tensor) into ``param``'s file and wait for it."""
        assert self.files is not None, "only a store with files writes them"
        name = self._names.setdefault(id(param), f"slice{len(self._names)}")
        self.files.write(name, piece.contiguous()).wait()

    def _load(self, held: _Held) -> torch.Tensor:
        """This rank's slice of ``held`` on the device (read from its file with NVMe)."""
        if self.files is None:
            return held.piece
        host = torch.empty(held.piece.numel(), dtype=held.piece.dtype)
        self.files.read(self._names[id(held.param)], host).wait()
        return host.to(self.device)

    def close(self) -> None:
        """Remove the slice files (after the exit made every parameter whole or sharded)."""
        if self.files is not None:
            self.files.close()

    def partition(self, param: torch.nn.Parameter) -> None:
        """Keep this rank's slice of the whole ``param`` and empty its ``.data``."""
        data = param.data
        dtype = self.dtype if self.dtype is not None and data.is_floating_point() else data.dtype
        numel, chunk = data.numel(), -(-data.numel() // self.world)
        lo, hi = min(self.rank * chunk, numel), min((self.rank + 1) * chunk, numel)
        where = self.device if self.files is None else torch.device("cpu")
        piece = torch.zeros(chunk, dtype=dtype, device=where)
        piece[: hi - lo].copy_(data.reshape(-1)[lo:hi])
        if self.files is not None:
            self._store(param, piece)
            piece.untyped_storage().resize_(0)  # the file is the slice's only copy
        handle = register_param_hook(param, SliceHook(self))
        self._held[id(param)] = _Held(param, tuple(data.shape), piece, handle)
        param.data = torch.empty(0, dtype=dtype, device=self.device)

    def _whole(self, held: _Held) -> torch.Tensor:
        piece = self._load(held)
        if self.world == 1 or held.numel == 0:
            return piece[: held.numel].clone().view(held.shape)
        out = all_gather_into_tensor(
            piece, group=self.group, logger=self._logger, log_name="zero3_init_gather"
        ).wait()
        return out[: held.numel].view(held.shape)

    def _keep_slice(self, held: _Held, whole: torch.Tensor) -> None:
        """This rank's slice of ``whole`` becomes ``held``'s (in memory or in its file)."""
        chunk = held.piece.numel()
        lo = min(self.rank * chunk, held.numel)
        hi = min(lo + chunk, held.numel)
        if self.files is None:
            held.piece[: hi - lo].copy_(whole.reshape(-1)[lo:hi])
            return
        piece = torch.zeros(chunk, dtype=held.piece.dtype)
        piece[: hi - lo].copy_(whole.reshape(-1)[lo:hi])
        self._store(held.param, piece)

    def materialize(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Make those of ``params`` held here whole (one all-gather each) and forget them."""
        for param in params:
            held = self._held.pop(id(param), None)
            if held is not None:
                held.handle.remove()
                param.data = self._whole(held)

    def gather(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Make ``params`` whole until as many `scatter` calls (`GatheredParameters`)."""
        for param in params:
            held = self._held[id(param)]
            if held.gathered == 0:
                param.data = self._whole(held)
            held.gathered += 1

    def scatter(self, params: Sequence[torch.nn.Parameter], modifier_rank: int | None) -> None:
        """End one `gather`: keep ``modifier_rank``'s values (broadcast), or drop changes."""
        for param in params:
            held = self._held[id(param)]
            if modifier_rank is not None:
                whole = param.data.contiguous()
                broadcast(whole, group_src=modifier_rank, group=self.group, logger=self._logger)
                self._keep_slice(held, whole)
            held.gathered -= 1
            if held.gathered == 0:
                param.data = torch.empty(0, dtype=held.piece.dtype, device=self.device)
