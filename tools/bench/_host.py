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
    """``"AMD EPYC (family 25 model 1, avx2, L3 32 MiB)"`` from parsed cpuinfo fields."""
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


def _last_level_cache() -> str | None:
    """``"L3 32 MiB"`` from sysfs: the highest cache level of CPU 0, or None where unreadable."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best: tuple[int, str] | None = None
    for index in base.glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, size)
    if best is None:
        return None
    level, size = best
    if size.endswith("K") and size[:-1].isdigit() and int(size[:-1]) % 1024 == 0:
        size = f"{int(size[:-1]) // 1024} MiB"
    elif size.endswith("K"):
        size = f"{size[:-1]} KiB"
    return f"L{level} {size}"


def cpu_description() -> str:
    """This machine's CPU in one line (see the module docstring)."""
    cpuinfo = Path("/proc/cpuinfo")
    try:
        fields = parse_cpuinfo(cpuinfo.read_text()) if cpuinfo.exists() else {}
    except OSError:
        fields = {}
    return describe(fields, _last_level_cache() if os.name == "posix" else None)
