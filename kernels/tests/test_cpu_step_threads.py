"""Steps split over worker threads give the twin's result, whoever calls and however split."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

import deepshard.kernels as kernels

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.0}


def _buffers(numel: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    param, grad, exp_avg, exp_avg_sq = (torch.randn(numel, generator=gen) for _ in range(4))
    return [param, grad, exp_avg, exp_avg_sq.abs()]  # a second moment is never negative


def test_small_and_large_steps_run_on_any_thread_count(simd_path):
    # 1 element, one thread below the split threshold, and an uneven split over 5 threads.
    for numel, threads in ((1, 4), (40_000, 2), (300_001, 5)):
        buffers = _buffers(numel, numel)
        twin = [b.clone() for b in buffers]
        with kernels.use_simd_path(simd_path):
            kernels.cpu_adam_step(*buffers, step=3, num_threads=threads, **HYPER)
        kernels.reference_adam_step(*twin, step=3, **HYPER)
        for a, b in zip(buffers, twin, strict=True):
            assert torch.equal(a, b), (numel, threads)


def test_concurrent_callers_share_the_pool_safely():
    # Four Python threads step their own tensors at once, each asking for 2 workers; the GIL is
    # released inside the step, so the pool really is used concurrently.
    jobs = [_buffers(200_003, seed) for seed in range(4)]
    twins = [[b.clone() for b in job] for job in jobs]
    errors: list[BaseException] = []

    def work(job: list[torch.Tensor]) -> None:
        try:
            for step in range(1, 6):
                kernels.cpu_adam_step(*job, step=step, num_threads=2, **HYPER)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    for job, twin in zip(jobs, twins, strict=True):
        for step in range(1, 6):
            kernels.reference_adam_step(*twin, step=step, **HYPER)
        for a, b in zip(job, twin, strict=True):
            assert torch.equal(a, b)


def test_a_forked_child_gets_its_own_pool():
    # The parent's workers do not exist in a fork()ed child; the child must start its own pool
    # instead of waiting forever for them.
    parent = _buffers(200_003, 0)
    kernels.cpu_adam_step(*parent, step=1, num_threads=2, **HYPER)  # parent pool now running
    shared = [b.clone().share_memory_() for b in parent]
    twin = [b.clone() for b in parent]
    pid = os.fork()
    if pid == 0:  # the child: step the shared tensors, report by exit status only
        try:
            kernels.cpu_adam_step(*shared, step=2, num_threads=2, **HYPER)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child hung in the step")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    kernels.reference_adam_step(*twin, step=2, **HYPER)
    for a, b in zip(shared, twin, strict=True):
        assert torch.equal(a, b)
