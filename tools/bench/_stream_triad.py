"""The machine's memory bandwidth, measured the way STREAM's triad measures it.

The triad is ``a[i] = b[i] + s * c[i]`` over three fp64 arrays, each at least four times the
last-level cache (STREAM's sizing rule), so every pass streams from DRAM. Like STREAM, a pass
is counted as 24 bytes per element (read b and c, write a) and a burst of passes reports its
best rate. The hardware moves more than that: storing to ``a`` first reads each of its cache
lines (write-allocate), so the true traffic is 32 bytes per element. STREAM does not count it
and neither do we; ``WRITE_ALLOCATE_FACTOR`` converts when a caller wants the true traffic.
An optimizer step that writes only to lines it has just read pays no write-allocate, so its
honest byte count can exceed 100% of the STREAM figure.

The loop is a few lines of C++ compiled on the fly with the system ``g++ -O3 -march=native``
and split over exactly ``threads`` ``std::thread`` workers (first touch uses the same split),
so the thread count does not depend on any OpenMP runtime's state. Without a compiler the
fallback is ``torch.add(b, c, alpha=s, out=a)`` on ``threads`` torch threads, which reaches
the same figure on the machines we tried; its label says which one ran.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch
from _host import last_level_cache_bytes

BYTES_PER_ELEMENT = 24
WRITE_ALLOCATE_FACTOR = 32 / 24
_MIN_ELEMENTS = 1 << 25  # 256 MiB per array: 4x a 64 MiB last-level cache
_SCALAR = 3.0

_SOURCE = r"""
#include <cstdint>
#include <thread>
#include <vector>

template <class Body>
static void split(int64_t n, int threads, Body body) {
    std::vector<std::thread> workers;
    const int64_t chunk = (n + threads - 1) / threads;
    for (int t = 0; t < threads; ++t) {
        const int64_t begin = t * chunk;
        const int64_t end = begin + chunk < n ? begin + chunk : n;
        if (begin < end) workers.emplace_back(body, begin, end);
    }
    for (auto& worker : workers) worker.join();
}

extern "C" void stream_fill(double* a, double* b, double* c, int64_t n, int threads) {
    split(n, threads, [=](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) { a[i] = 1.0; b[i] = 2.0; c[i] = 0.5; }
    });
}

extern "C" void stream_triad(double* __restrict a, const double* __restrict b,
                             const double* __restrict c, double s, int64_t n, int threads) {
    split(n, threads, [=](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
    });
}
"""


def triad_elements() -> int:
    """Elements per array: at least 4x the last-level cache, never under 32 Mi elements."""
    return max(_MIN_ELEMENTS, 4 * last_level_cache_bytes() // 8)


class StreamTriad:
    """Three resident fp64 arrays and a triad kernel bound to one thread count.

    The arrays stay allocated for the object's life so that a burst can be measured right
    before and after each benchmark row, under the same load as the row itself.

    Args:
        threads: Worker threads per pass.
        elements: Elements per array (see `triad_elements`).
        build_dir: Where the C++ kernel is compiled; a throwaway folder.
    """

    def __init__(self, threads: int, elements: int, build_dir: Path) -> None:
        self.threads = threads
        self.elements = elements
        self._arrays = [torch.empty(elements, dtype=torch.float64) for _ in range(3)]
        self._lib = _compile(build_dir)
        self.history: list[float] = []  # every burst's GB/s, for the report's range
        self.implementation = (
            "C++ std::thread loop (g++ -O3 -march=native)"
            if self._lib is not None
            else "torch.add(b, c, alpha=s, out=a) (no g++ found)"
        )
        self._fill()

    def _fill(self) -> None:
        a, b, c = self._arrays
        if self._lib is None:
            a.fill_(1.0), b.fill_(2.0), c.fill_(0.5)
        else:
            self._lib.stream_fill(*self._pointers(), ctypes.c_int64(self.elements), self.threads)

    def _pointers(self) -> list[ctypes.c_void_p]:
        return [ctypes.c_void_p(array.data_ptr()) for array in self._arrays]

    def _pass(self) -> None:
        a, b, c = self._arrays
        if self._lib is None:
            torch.add(b, c, alpha=_SCALAR, out=a)
            return
        n = ctypes.c_int64(self.elements)
        self._lib.stream_triad(*self._pointers(), ctypes.c_double(_SCALAR), n, self.threads)

    def burst(self, passes: int) -> float:
        """Runs ``passes`` triads and returns the best rate in GB/s (24 bytes per element)."""
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            self._pass()
            best = min(best, time.perf_counter() - start)
        a, b, c = self._arrays
        if not bool(a[-1] == b[-1] + _SCALAR * c[-1]):
            raise RuntimeError("the STREAM triad produced a wrong value; the kernel is broken")
        self.history.append(BYTES_PER_ELEMENT * self.elements / best / 1e9)
        return self.history[-1]


def _compile(build_dir: Path) -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return None
    source, library = build_dir / "stream_triad.cpp", build_dir / "stream_triad.so"
    source.write_text(_SOURCE)
    flags = ["-O3", "-march=native", "-shared", "-fPIC", "-pthread", "-std=c++17"]
    subprocess.run([compiler, *flags, str(source), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.stream_fill.argtypes = [pointer, pointer, pointer, size, ctypes.c_int]
    lib.stream_triad.argtypes = [pointer, pointer, pointer, ctypes.c_double, size, ctypes.c_int]
    return lib
