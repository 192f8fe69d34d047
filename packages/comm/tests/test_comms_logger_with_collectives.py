"""The comms logger on real gloo collectives: exact bytes, per-call latency, disabled means off.

Expected byte counts are derived here from numel x element_size and the nccl-tests conventions
(gathered and scattered buffers count in full), not read back from the library.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import deepshard.comm as comm
from deepshard.interface.config.comms_logger import CommsLoggerConfig

# Rank 1 arrives this late at the first collective, and callers sleep this long before wait().
# Assertions compare against generous fractions of it, so a busy 2-core machine (slow process
# scheduling, seconds of jitter elsewhere) does not flip them.
SLEEP_S = 1.0


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


def _log_each_collective(mesh: Any) -> dict[str, Any]:
    rank, group = mesh.get_rank(), mesh["dp"]
    n = group.size()
    logger = comm.CommsLogger(CommsLoggerConfig(enabled=True))
    comm.all_reduce(torch.ones(10, dtype=torch.float32), group=group, logger=logger)
    comm.all_gather_into_tensor(torch.ones(6, dtype=torch.float64), group=group, logger=logger)
    comm.reduce_scatter_tensor(
        torch.ones(4 * n, dtype=torch.bfloat16), group=group, logger=logger, log_name="grads"
    )
    splits = [rank + 1] * n  # rank r sends r + 1 rows of 5 to everyone
    comm.all_to_all_single(
        torch.ones(sum(splits), 5),
        group=group,
        input_split_sizes=splits,
        output_split_sizes=[j + 1 for j in range(n)],
        logger=logger,
    )
    comm.broadcast(torch.ones(7, dtype=torch.int64), group_src=1, group=group, logger=logger)
    handle = comm.barrier(group=group, async_op=True, logger=logger)
    handle.wait()
    handle.wait()  # a second wait must not log a second call
    return {
        "records": [(r.op, r.log_name, r.msg_bytes, r.world_size) for r in logger.records],
        "summary": logger.summary(),
    }


def test_logger_records_exact_bytes_of_each_call(run_on_mesh: Any) -> None:
    n = 2
    results = run_on_mesh(_log_each_collective, n)
    for rank, got in enumerate(results):
        expected = [
            ("all_reduce", "all_reduce", _nbytes(10, torch.float32), n),
            ("all_gather_into_tensor", "all_gather_into_tensor", _nbytes(n * 6, torch.float64), n),
            ("reduce_scatter_tensor", "grads", _nbytes(4 * n, torch.bfloat16), n),
            (
                "all_to_all_single",
                "all_to_all_single",
                _nbytes(n * (rank + 1) * 5, torch.float32),
                n,
            ),
            ("broadcast", "broadcast", _nbytes(7, torch.int64), n),
            ("barrier", "barrier", 0, n),
        ]
        assert got["records"] == expected
        for op, *_ in expected:
            assert op in got["summary"]


def _late_rank_then_quick_call(mesh: Any) -> list[float]:
    """Rank 1 joins the first all_reduce late; the second all_reduce follows at once."""
    group = mesh["dp"]
    logger = comm.CommsLogger(CommsLoggerConfig(enabled=True))
    if mesh.get_rank() == 1:
        time.sleep(SLEEP_S)
    comm.all_reduce(torch.ones(4), group=group, logger=logger, log_name="late")
    pending = comm.all_reduce(torch.ones(4), group=group, logger=logger, async_op=True)
    pending.wait()
    return [r.latency_s for r in logger.records]


def test_latency_is_per_call_not_cumulative(run_on_mesh: Any) -> None:
    (first0, second0), (first1, second1) = run_on_mesh(_late_rank_then_quick_call, 2)
    # Rank 0 waited for rank 1 inside the first call ...
    assert first0 >= 0.5 * SLEEP_S
    # ... and the quick second call must not carry that wait (cumulative timing would).
    assert second0 < 0.5 * SLEEP_S
    assert second1 < 0.5 * SLEEP_S and first1 < 0.5 * SLEEP_S


def _async_latency_excludes_work_before_wait(mesh: Any) -> dict[str, Any]:
    logger = comm.CommsLogger(CommsLoggerConfig(enabled=True))
    handle = comm.all_reduce(torch.ones(4), group=mesh["dp"], logger=logger, async_op=True)
    time.sleep(SLEEP_S)  # overlapped "compute" done by the caller, not by the collective
    handle.wait()
    time.sleep(0.1)
    handle.wait()  # a second wait records nothing
    return {
        "latencies": [r.latency_s for r in logger.records],
        "seen_at_clock": _clock_stop_sees_the_sum_not_the_mean(mesh),
    }


def _clock_stop_sees_the_sum_not_the_mean(mesh: Any) -> list[float]:
    """Read the reduced tensor whenever the logger's clock is read: start, and stop."""
    seen: list[float] = []
    tensor = torch.ones(3)

    def clock() -> float:
        seen.append(float(tensor[0]))
        return time.perf_counter()

    logger = comm.CommsLogger(CommsLoggerConfig(enabled=True), clock=clock)
    comm.all_reduce(tensor, group=mesh["dp"], op="avg", logger=logger).wait()
    tensor.fill_(1.0)
    comm.all_reduce(tensor, group=mesh["dp"], op="avg", logger=logger, async_op=True).wait()
    return seen


def test_async_latency_excludes_work_before_wait_and_the_avg_division(
    run_on_mesh: Any,
) -> None:
    n = 2
    for got in run_on_mesh(_async_latency_excludes_work_before_wait, n):
        assert len(got["latencies"]) == 1
        # Both ranks issue at once, so the call completes long before the sleep ends.
        assert 0.0 <= got["latencies"][0] < 0.5 * SLEEP_S
        # gloo averages as a sum then a division: at the stop the tensor holds the sum of n ones
        # (the division, the caller's step, is not timed); at the start, this rank's ones.
        assert got["seen_at_clock"] == [1.0, float(n), 1.0, float(n)]


class _CountingSync:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, device: torch.device | None) -> None:
        self.calls += 1


def _disabled_logger(mesh: Any) -> tuple[int, int, int]:
    group = mesh["dp"]
    spy = _CountingSync()
    logger = comm.CommsLogger(CommsLoggerConfig(enabled=False), synchronize=spy)
    comm.all_reduce(torch.ones(4), group=group, logger=logger)
    comm.all_gather_into_tensor(torch.ones(2), group=group, logger=logger, async_op=True).wait()
    comm.barrier(group=group, logger=logger)
    enabled_spy = _CountingSync()
    enabled = comm.CommsLogger(CommsLoggerConfig(enabled=True), synchronize=enabled_spy)
    comm.all_reduce(torch.ones(4), group=group, logger=enabled)
    return logger.call_count, spy.calls, enabled_spy.calls


def test_disabled_logger_times_and_synchronizes_nothing(run_on_mesh: Any) -> None:
    for count, sync_calls, enabled_sync_calls in run_on_mesh(_disabled_logger, 2):
        assert count == 0
        assert sync_calls == 0
        assert enabled_sync_calls == 2  # the spy does see calls when the logger is on
