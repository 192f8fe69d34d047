"""CommsLogger bookkeeping in one process: filters, bandwidth formulas, summary, reset.

A fake clock makes every latency exact, so bandwidths are checked against the nccl-tests
formulas written out here (not against numbers copied from the implementation).
"""

from __future__ import annotations

import io

import pytest
import torch

from deepshard.comm import CommsLogger
from deepshard.interface.config.comms_logger import CommsLoggerConfig
from deepshard.interface.errors import ConfigError


class FakeClock:
    """A clock that advances only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class SyncSpy:
    def __init__(self) -> None:
        self.devices: list[torch.device | None] = []

    def __call__(self, device: torch.device | None) -> None:
        self.devices.append(device)


def _timed_call(logger: CommsLogger, clock: FakeClock, op: str, seconds: float, **kw: object):
    timing = logger.start(op, msg_bytes=kw.pop("msg_bytes", 1024), world_size=4, **kw)  # type: ignore[arg-type]
    clock.now += seconds
    return None if timing is None else logger.stop(timing)


def test_disabled_logger_records_nothing_and_never_synchronizes() -> None:
    spy, clock = SyncSpy(), FakeClock()
    logger = CommsLogger(CommsLoggerConfig(enabled=False), synchronize=spy, clock=clock)
    assert logger.start("all_reduce", msg_bytes=8, world_size=2, device=torch.device("cpu")) is None
    assert logger.record("all_reduce", msg_bytes=8, latency_s=1.0, world_size=2) is None
    assert logger.call_count == 0
    assert logger.records == ()
    assert spy.devices == []
    assert CommsLogger().enabled is False  # the default config is disabled too


def test_enabled_logger_synchronizes_before_start_and_stop() -> None:
    spy, clock = SyncSpy(), FakeClock()
    logger = CommsLogger(CommsLoggerConfig(enabled=True), synchronize=spy, clock=clock)
    dev = torch.device("cpu")
    timing = logger.start("broadcast", msg_bytes=8, world_size=2, device=dev)
    assert spy.devices == [dev]
    assert timing is not None
    logger.stop(timing)
    assert spy.devices == [dev, dev]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_bandwidth_follows_nccl_tests_formulas(n: int) -> None:
    clock = FakeClock()
    logger = CommsLogger(CommsLoggerConfig(enabled=True), synchronize=SyncSpy(), clock=clock)
    seconds, nbytes = 0.5, 4096
    expected_factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather_into_tensor": (n - 1) / n,
        "reduce_scatter_tensor": (n - 1) / n,
        "all_to_all_single": (n - 1) / n,
        "broadcast": 1.0,
    }
    for op, factor in expected_factor.items():
        timing = logger.start(op, msg_bytes=nbytes, world_size=n)
        assert timing is not None
        clock.now += seconds
        rec = logger.stop(timing)
        assert rec.latency_s == pytest.approx(seconds)
        assert rec.algbw == pytest.approx(nbytes / seconds)
        assert rec.busbw == pytest.approx(nbytes / seconds * factor)
        assert rec.note is None
    barrier = logger.record("barrier", msg_bytes=0, latency_s=0.1, world_size=n)
    assert barrier is not None and barrier.algbw == 0.0 and barrier.busbw == 0.0


def test_unknown_op_is_logged_with_factor_one_and_a_note() -> None:
    logger = CommsLogger(CommsLoggerConfig(enabled=True), synchronize=SyncSpy())
    rec = logger.record("my_fused_exchange", msg_bytes=1000, latency_s=0.25, world_size=4)
    assert rec is not None
    assert rec.busbw == pytest.approx(rec.algbw) == pytest.approx(1000 / 0.25)
    assert rec.note is not None and "my_fused_exchange" in rec.note
    assert "my_fused_exchange" in logger.summary()
    assert "note:" in logger.summary()


def test_log_name_defaults_to_the_op_and_can_be_set() -> None:
    clock = FakeClock()
    logger = CommsLogger(CommsLoggerConfig(enabled=True), synchronize=SyncSpy(), clock=clock)
    plain = _timed_call(logger, clock, "all_reduce", 0.1)
    named = _timed_call(logger, clock, "all_reduce", 0.1, log_name="grad_sync")
    assert plain.log_name == "all_reduce"
    assert named.log_name == "grad_sync" and named.op == "all_reduce"


def test_prof_all_false_logs_only_listed_ops_or_names() -> None:
    clock = FakeClock()
    cfg = CommsLoggerConfig(enabled=True, prof_all=False, prof_ops=["broadcast", "grad_sync"])
    logger = CommsLogger(cfg, synchronize=SyncSpy(), clock=clock)
    assert _timed_call(logger, clock, "all_reduce", 0.1) is None
    assert _timed_call(logger, clock, "broadcast", 0.1) is not None
    assert _timed_call(logger, clock, "all_reduce", 0.1, log_name="grad_sync") is not None
    assert [r.log_name for r in logger.records] == ["broadcast", "grad_sync"]


def test_debug_appends_the_calling_function() -> None:
    logger = CommsLogger(CommsLoggerConfig(enabled=True, debug=True), synchronize=SyncSpy())

    def my_training_step() -> None:
        timing = logger.start("all_reduce", msg_bytes=4, world_size=2)
        assert timing is not None
        logger.stop(timing)

    my_training_step()
    assert logger.records[0].log_name == "all_reduce | my_training_step"


def test_summary_aggregates_per_op_and_size() -> None:
    clock = FakeClock()
    logger = CommsLogger(CommsLoggerConfig(enabled=True), synchronize=SyncSpy(), clock=clock)
    latencies = [0.1, 0.3]
    for s in latencies:
        _timed_call(logger, clock, "all_reduce", s, msg_bytes=2048)
    _timed_call(logger, clock, "all_reduce", 0.2, msg_bytes=4096)
    _timed_call(logger, clock, "broadcast", 0.2, msg_bytes=2048)
    table = logger.summary()
    rows = [line.split() for line in table.splitlines()]
    ar_2k = next(r for r in rows if r[0] == "all_reduce" and r[2:4] == ["2.00", "KiB"])
    ranks, count, total_ms, avg_ms, algbw = ar_2k[4], ar_2k[5], ar_2k[6], ar_2k[7], ar_2k[8]
    assert int(ranks) == 4
    assert int(count) == len(latencies)
    assert float(total_ms) == pytest.approx(sum(latencies) * 1e3, abs=1e-3)
    assert float(avg_ms) == pytest.approx(sum(latencies) / len(latencies) * 1e3, abs=1e-3)
    mean_algbw = sum(2048 / s for s in latencies) / len(latencies) / 1e9
    assert float(algbw) == pytest.approx(mean_algbw, abs=1e-3)
    assert any(r[0] == "all_reduce" and r[2:4] == ["4.00", "KiB"] for r in rows)
    assert any(r[0] == "broadcast" for r in rows)
    assert logger.call_count == 4


def test_print_summary_maybe_print_and_reset() -> None:
    logger = CommsLogger(CommsLoggerConfig(enabled=True), synchronize=SyncSpy())
    logger.record("all_gather_into_tensor", msg_bytes=64, latency_s=0.01, world_size=2)
    out = io.StringIO()
    logger.print_summary(out)
    assert "all_gather_into_tensor" in out.getvalue()
    out = io.StringIO()
    assert logger.maybe_print_summary(3, 2, file=out) is False
    assert out.getvalue() == ""
    assert logger.maybe_print_summary(0, 2, file=out) is False
    assert logger.maybe_print_summary(4, 2, file=out) is True
    assert "all_gather_into_tensor" in out.getvalue()
    with pytest.raises(ConfigError, match="steps_per_print"):
        logger.maybe_print_summary(4, 0)
    logger.reset()
    assert logger.call_count == 0 and logger.records == ()
    assert "no calls" in logger.summary()


def test_verbose_prints_one_line_per_call_on_rank_zero_only() -> None:
    cfg = CommsLoggerConfig(enabled=True, verbose=True)
    for rank, expected_lines in ((0, 1), (1, 0)):
        out = io.StringIO()
        logger = CommsLogger(cfg, synchronize=SyncSpy(), rank=rank, stream=out)
        logger.record("all_reduce", msg_bytes=8, latency_s=0.5, world_size=2, log_name="x")
        assert len(out.getvalue().splitlines()) == expected_lines
        assert logger.call_count == 1


def test_verbose_prints_on_rank_zero_of_the_calls_group() -> None:
    cfg = CommsLoggerConfig(enabled=True, verbose=True)
    out = io.StringIO()
    logger = CommsLogger(cfg, synchronize=SyncSpy(), stream=out)  # no logger-wide rank
    logger.record("all_reduce", msg_bytes=8, latency_s=0.5, world_size=2, group_rank=1)
    assert out.getvalue() == ""
    timing = logger.start("all_reduce", msg_bytes=8, world_size=2, group_rank=0)
    assert timing is not None
    logger.stop(timing)
    assert len(out.getvalue().splitlines()) == 1
    # A logger-wide rank wins over the group's.
    quiet = io.StringIO()
    ranked = CommsLogger(cfg, synchronize=SyncSpy(), rank=3, stream=quiet)
    ranked.record("all_reduce", msg_bytes=8, latency_s=0.5, world_size=2, group_rank=0)
    assert quiet.getvalue() == ""


def test_verbose_without_any_rank_is_refused_before_timing() -> None:
    spy = SyncSpy()
    logger = CommsLogger(CommsLoggerConfig(enabled=True, verbose=True), synchronize=spy)
    with pytest.raises(ConfigError, match="rank="):
        logger.start("all_reduce", msg_bytes=8, world_size=2)
    with pytest.raises(ConfigError, match="rank="):
        logger.record("all_reduce", msg_bytes=8, latency_s=0.5, world_size=2)
    assert spy.devices == [] and logger.call_count == 0
    # Without verbose nothing is printed, so no rank is needed.
    CommsLogger(CommsLoggerConfig(enabled=True)).record(
        "all_reduce", msg_bytes=8, latency_s=0.5, world_size=2
    )


def test_summary_separates_group_sizes() -> None:
    logger = CommsLogger(CommsLoggerConfig(enabled=True), synchronize=SyncSpy())
    for world_size in (2, 8):
        logger.record("all_reduce", msg_bytes=1024, latency_s=0.5, world_size=world_size)
    rows = [line.split() for line in logger.summary().splitlines()[2:]]
    assert [(r[0], int(r[4]), int(r[5])) for r in rows] == [
        ("all_reduce", 2, 1),
        ("all_reduce", 8, 1),
    ]
    # all_reduce bus bandwidth is algbw * 2 (n - 1) / n, so the rows differ by that factor.
    algbw = 1024 / 0.5 / 1e9
    for r, n in zip(rows, (2, 8), strict=True):
        assert float(r[9]) == pytest.approx(algbw * 2 * (n - 1) / n, rel=1e-3)


def test_records_are_bounded_but_the_summary_counts_every_call() -> None:
    logger = CommsLogger(CommsLoggerConfig(enabled=True), synchronize=SyncSpy(), max_records=3)
    for _ in range(5):
        logger.record("all_reduce", msg_bytes=8, latency_s=0.5, world_size=2)
    assert len(logger.records) == 3
    assert logger.call_count == 5
    with pytest.raises(ConfigError, match="max_records"):
        CommsLogger(max_records=0)
