"""Which CPU a benchmark ran on, in one line, read from the OS without importing torch.

Virtual machines often report a bare marketing name ("AMD EPYC", "Intel Xeon Processor"), which
does not say which generation the figures belong to. The line therefore adds what tells them
apart: the vendor's family/model numbers (x86), the widest SIMD extension the kernels can use,
and the last-level cache size.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# widest first: the first one present is the one the compiled kernels dispatch to
_SIMD_FLAGS = ("avx512f", "avx2", "sve", "asimd")


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's ``key: value`` lines of a ``/proc/cpuinfo`` text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # end of the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def describe(fields: dict[str, str], last_level_cache: str | None = None) -> str:
    """``"AMD EPYC (family 25 model 1, avx2, LLC 32 MiB)"`` from parsed cpuinfo fields."""
    name = fields.get("model name") or fields.get("Processor") or platform.processor() or "unknown"
    details = []
    if "cpu family" in fields and "model" in fields:
        details.append(f"family {fields['cpu family']} model {fields['model']}")
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    simd = next((flag for flag in _SIMD_FLAGS if flag in flags), None)
    if simd is not None:
        details.append(simd)
    if last_level_cache:
        details.append(last_level_cache)
    return f"{name} ({', '.join(details)})" if details else name


_SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache_bytes(caches: Path = _SYSFS_CACHES) -> int:
    """Bytes of CPU 0's highest-level cache; 0 when neither source reports one.

    Linux's sysfs (``caches``: one ``index*`` folder per cache with ``level`` and ``size``, e.g.
    ``32768K``) comes first: glibc's ``sysconf`` answer is read from CPUID and is 0 on some
    virtual machines (this 2-vCPU EPYC VM among them) whose sysfs lists the L3. Elsewhere the
    largest of glibc's L3 and L2 sizes.
    """
    best: tuple[int, int] | None = None
    for index in caches.glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
            size = int(text[:-1]) * _UNITS[text[-1]] if text[-1:] in _UNITS else int(text)
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, size)
    if best is not None:
        return best[1]
    largest = 0
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            largest = max(largest, int(os.sysconf(name)))
        except (ValueError, OSError):
            continue
    return largest


def _cache_text(size: int) -> str | None:
    """``"LLC 32 MiB"`` for a last-level cache of ``size`` bytes; None when unknown (0)."""
    if size <= 0:
        return None
    if size % (1 << 20) == 0:
        return f"LLC {size >> 20} MiB"
    return f"LLC {size >> 10} KiB"


def cpu_description() -> str:
    """This machine's CPU in one line (see the module docstring)."""
    cpuinfo = Path("/proc/cpuinfo")
    try:
        fields = parse_cpuinfo(cpuinfo.read_text()) if cpuinfo.exists() else {}
    except OSError:
        fields = {}
    return describe(fields, _cache_text(last_level_cache_bytes()))
