"""Smoke run of deepshard-comm on several ranks: set-up, mesh, collectives, comms logger.

Run from the repository root:

    uv run --all-packages torchrun --standalone --nproc_per_node=2 examples/comm_smoke.py

Each rank contributes a rank-dependent tensor; the all-reduce is checked against its closed form
and the all-gather against the tensors every rank must have sent. Rank 0 prints the comms-logger
summary and "comm smoke OK".
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import deepshard.comm as comm
from deepshard.accelerators import get_accelerator
from deepshard.interface import Topology
from deepshard.interface.config.comms_logger import CommsLoggerConfig

NUMEL = 1024


def main() -> None:
    info = comm.init_distributed()
    device = get_accelerator().current_device()
    world, rank = info.world_size, info.rank
    mesh = comm.build_mesh(Topology.from_world(world))
    dp = mesh["dp"]
    logger = comm.CommsLogger(CommsLoggerConfig(enabled=True))

    # Rank r holds (r + 1) * [0, 1, ..., NUMEL-1]; the sum over ranks is world(world+1)/2 * [...].
    ramp = torch.arange(NUMEL, dtype=torch.float64, device=device)
    summed = comm.all_reduce((rank + 1) * ramp, group=dp, logger=logger).wait()
    torch.testing.assert_close(summed, world * (world + 1) / 2 * ramp)

    averaged = comm.all_reduce((rank + 1) * ramp, group=dp, op="avg", logger=logger).wait()
    torch.testing.assert_close(averaged, (world + 1) / 2 * ramp)

    # Rank r sends [r, r, r]; the gathered tensor is each rank's value in rank order.
    mine = torch.full((3,), float(rank), device=device)
    handle = comm.all_gather_into_tensor(mine, group=dp, async_op=True, logger=logger)
    gathered = handle.wait()
    expected = torch.arange(world, dtype=mine.dtype, device=device).repeat_interleave(3)
    torch.testing.assert_close(gathered, expected)

    comm.barrier(group=dp, logger=logger)
    if rank == 0:
        logger.print_summary()
        print(f"comm smoke OK ({world} ranks, backend {info.backend})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
