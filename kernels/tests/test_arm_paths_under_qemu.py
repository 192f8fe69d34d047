"""The NEON and SVE optimizer paths match the scalar path bit for bit, run under qemu-user.

``tests/native/arm_paths_driver.cpp`` is cross-compiled for aarch64 together with
``csrc/cpu/path_{scalar,neon,sve}.cpp`` (each with the flags CMakeLists.txt gives it) and run with
qemu-aarch64 three times: the NEON path on a Cortex-A72 model (armv8.0, so an instruction from a
later extension would trap), and the SVE path with 128-bit and with 512-bit vectors. The driver
runs Adam/AdamW/Lion over every dtype combination and many sizes for 10 steps and exits non-zero
naming the first mismatch (see its header for the cases: fp32, bf16 and fp16 parameters).

The cross compiler (``g++-aarch64-linux-gnu``) and ``qemu-user`` are installed with apt-get when
they are missing and the tests run as root (as in CI), once per session and under a lock so that
concurrent sessions do not race; otherwise the tests are skipped with the reason. The time spent
installing, building and running is printed (visible with ``pytest -rA``).
"""

from __future__ import annotations

import fcntl
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1]
CPU_SRC = KERNELS / "csrc" / "cpu"
DRIVER_SRC = KERNELS / "tests" / "native" / "arm_paths_driver.cpp"
APT_PACKAGES = ("g++-aarch64-linux-gnu", "qemu-user")
LOCK_FILE = Path("/tmp/deepshard-arm-toolchain.lock")
COMMON_FLAGS = ("-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra")
# Each translation unit with the -march CMakeLists.txt uses for it on aarch64.
UNITS = (
    (CPU_SRC / "path_scalar.cpp", "-march=armv8-a"),
    (CPU_SRC / "path_neon.cpp", "-march=armv8-a+simd"),
    (CPU_SRC / "path_sve.cpp", "-march=armv8.2-a+sve"),
    (DRIVER_SRC, "-march=armv8-a"),
)


@dataclass(frozen=True)
class Toolchain:
    """The tools the tests run."""

    compiler: str
    qemu: str


def _find_tools() -> tuple[str | None, str | None]:
    compiler = shutil.which("aarch64-linux-gnu-g++")
    if compiler is None and platform.machine() in ("aarch64", "arm64"):
        compiler = shutil.which("g++")
    return compiler, shutil.which("qemu-aarch64")


def _apt_install() -> str | None:
    """Installs the cross compiler and qemu with apt-get; returns why it failed, or None."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]
    result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:  # a fresh image has no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        return f"`{' '.join(install)}` failed: {result.stderr.strip()[-500:]}"
    return None


def _install_tools() -> str | None:
    """Installs the missing tools if allowed (root with apt-get); returns why not, or None."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return (
            "the aarch64 cross compiler or qemu-aarch64 is missing and this is not root with "
            f"apt-get; install them with `apt-get install {' '.join(APT_PACKAGES)}`"
        )
    with LOCK_FILE.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be installing right now
        try:
            if None not in _find_tools():
                return None
            return _apt_install()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def toolchain() -> Toolchain:
    """The cross compiler and qemu, installed at most once per session."""
    start = time.monotonic()
    compiler, qemu = _find_tools()
    if compiler is None or qemu is None:
        reason = _install_tools()
        compiler, qemu = _find_tools()
        if reason is not None or compiler is None or qemu is None:
            pytest.skip(reason or "apt-get succeeded but aarch64-linux-gnu-g++/qemu-aarch64 absent")
    seconds = time.monotonic() - start
    print(f"arm toolchain ready in {seconds:.1f} s (apt-get included when it ran)")
    return Toolchain(compiler=compiler, qemu=qemu)


@pytest.fixture(scope="session")
def driver(toolchain: Toolchain, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The driver, built statically (no aarch64 sysroot needed at run time)."""
    out = tmp_path_factory.mktemp("arm_driver")
    start = time.monotonic()
    objects: list[str] = []
    jobs: list[tuple[str, subprocess.Popen[str]]] = []
    for source, march in UNITS:
        obj = out / f"{source.stem}.o"
        command = [toolchain.compiler, *COMMON_FLAGS, march, f"-I{CPU_SRC}", "-c", str(source)]
        command += ["-o", str(obj)]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        jobs.append((" ".join(command), process))
        objects.append(str(obj))
    for command_line, process in jobs:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"cross-compiling failed: {command_line}\n{output}"
    binary = out / "arm_paths_driver"
    link = subprocess.run(
        [toolchain.compiler, "-static", "-o", str(binary), *objects],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert link.returncode == 0, f"linking the driver failed:\n{link.stderr}"
    print(f"arm driver built in {time.monotonic() - start:.1f} s")
    return binary


# (test id, qemu -cpu value, driver arguments)
RUNS = (
    ("neon", "cortex-a72", ("neon",)),
    ("sve128", "max,sve128=on", ("sve", "--expect-sve-bits", "128")),
    ("sve512", "max,sve512=on", ("sve", "--expect-sve-bits", "512")),
)


@dataclass(frozen=True)
class QemuRun:
    """One started qemu run of the driver."""

    command: str
    process: subprocess.Popen[str]


@pytest.fixture(scope="session")
def qemu_runs(toolchain: Toolchain, driver: Path) -> dict[str, QemuRun]:
    """All qemu runs, started at once so they share the machine's cores; each test awaits one."""
    runs = {}
    for name, cpu, args in RUNS:
        command = [toolchain.qemu, "-cpu", cpu, str(driver), *args]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        runs[name] = QemuRun(command=" ".join(command), process=process)
    return runs


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test pays for the apt-get install and the build
@pytest.mark.parametrize("name", [name for name, _, _ in RUNS])
def test_arm_path_matches_scalar_under_qemu(qemu_runs: dict[str, QemuRun], name: str) -> None:
    run = qemu_runs[name]
    start = time.monotonic()
    stdout, stderr = run.process.communicate(timeout=600)
    print(f"{run.command}: done {time.monotonic() - start:.1f} s after this test began\n{stdout}")
    assert run.process.returncode == 0, (
        f"{run.command} failed (exit {run.process.returncode}):\n{stdout}\n{stderr[-4000:]}"
    )
    assert "OK:" in stdout
