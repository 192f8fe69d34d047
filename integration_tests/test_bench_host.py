"""``tools/bench/_host.py``: the one-line CPU description every benchmark report carries.

Functions of text, checked on cpuinfo excerpts of the kinds of machine the figures come from: an
x86 VM whose name hides the generation, an AVX-512 Xeon, an ARM server, and nothing readable.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "bench"))
import _host  # (the bench's modules import each other by bare name)

ZEN3_VM = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma avx2 bmi2

processor\t: 1
model name\t: something else
"""
XEON = """processor : 0
cpu family : 6
model : 143
model name : Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags : sse2 avx avx2 avx512f avx512bw
"""
ARM = """processor : 0
Features : fp asimd evtstrm sve
CPU implementer : 0x41
"""


def test_a_vm_cpu_is_told_apart_by_family_model_simd_and_cache() -> None:
    fields = _host.parse_cpuinfo(ZEN3_VM)
    assert fields["model name"] == "AMD EPYC"  # the first processor's block, not the second's
    assert _host.describe(fields, "LLC 32 MiB") == "AMD EPYC (family 25 model 1, avx2, LLC 32 MiB)"


def test_the_widest_simd_extension_is_named() -> None:
    text = _host.describe(_host.parse_cpuinfo(XEON))
    assert text == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (family 6 model 143, avx512f)"
    assert _host.describe(_host.parse_cpuinfo(ARM)).endswith("(sve)")


def test_the_cache_size_is_written_in_mib_or_kib() -> None:
    assert _host._cache_text(32 << 20) == "LLC 32 MiB"
    assert _host._cache_text(512 << 10) == "LLC 512 KiB"
    assert _host._cache_text(0) is None  # glibc reported no cache


def test_the_last_level_cache_comes_from_sysfs_first(tmp_path: Path) -> None:
    for index, (level, size) in enumerate([(1, "32K"), (2, "512K"), (3, "32768K")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "size").write_text(f"{size}\n")
    assert _host.last_level_cache_bytes(tmp_path) == 32 << 20
    # an empty sysfs falls back to glibc's answer, whatever it is here (never negative)
    assert _host.last_level_cache_bytes(tmp_path / "missing") >= 0


def test_nothing_readable_still_gives_a_line() -> None:
    text = _host.describe({}, None)
    assert text and "(" not in text


def test_this_machine_gets_a_non_empty_line() -> None:
    assert _host.cpu_description().strip()
