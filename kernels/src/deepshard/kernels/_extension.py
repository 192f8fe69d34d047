"""Lazy loading of the compiled CPU extension, with one warning when it cannot be loaded.

Importing deepshard.kernels loads nothing; the first op call (or report) imports the extension.
When that import fails (no build for this platform, a broken build, a missing symbol), the ops
fall back to their pure-torch twins and exactly one ``RuntimeWarning`` says why. After a
successful import the SIMD path named by ``DEEPSHARD_CPU_SIMD``, if set, is made active.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from collections.abc import Mapping
from typing import Protocol, cast

__all__ = ["CPU_EXTENSION", "SIMD_ENV_VAR", "CpuExtension", "ExtensionLoader"]

SIMD_ENV_VAR = "DEEPSHARD_CPU_SIMD"


class CpuExtension(Protocol):
    """The functions of the compiled module ``deepshard.kernels._cpu`` (csrc/cpu/bindings.cpp)."""

    def compiled_paths(self) -> tuple[str, ...]: ...
    def supported_paths(self) -> tuple[str, ...]: ...
    def best_path(self) -> str: ...
    def active_path(self) -> str: ...
    def set_path(self, name: str) -> None: ...

    def adam_step(
        self, param: int, param_type: int, grad: int, grad_type: int, exp_avg: int,
        exp_avg_sq: int, state: int, param_out: int, out: int, numel: int, lr: float,
        beta1: float, beta2: float, eps: float, weight_decay: float, bias_correction1: float,
        bias_correction2_sqrt: float, adamw_mode: bool, num_threads: int,
    ) -> None: ...  # fmt: skip

    def lion_step(
        self, param: int, param_type: int, grad: int, grad_type: int, exp_avg: int, state: int,
        param_out: int, out: int, numel: int, lr: float, beta1: float, beta2: float,
        weight_decay: float, num_threads: int,
    ) -> None: ...  # fmt: skip


class ExtensionLoader:
    """Imports a compiled module on first use and remembers the outcome.

    Args:
        module: Dotted name of the compiled module.
        env: Environment to read ``DEEPSHARD_CPU_SIMD`` from; ``None`` means ``os.environ``.
    """

    def __init__(self, module: str, env: Mapping[str, str] | None = None) -> None:
        self._module_name = module
        self._env = env
        self._lock = threading.Lock()
        self._module: CpuExtension | None = None
        self._failure: str | None = None

    @property
    def module_name(self) -> str:
        """Dotted name of the compiled module."""
        return self._module_name

    def get(self) -> CpuExtension | None:
        """Returns the loaded module, or ``None`` (after one warning) when it cannot be loaded.

        Raises:
            ValueError: ``DEEPSHARD_CPU_SIMD`` names a path this build or CPU cannot run.
        """
        with self._lock:
            if self._module is not None or self._failure is not None:
                return self._module
            try:
                module = cast(CpuExtension, importlib.import_module(self._module_name))
            except (ImportError, OSError) as error:
                self._failure = _describe_failure(error, self._module_name)
                warnings.warn(
                    f"deepshard.kernels: cannot load the compiled extension "
                    f"{self._module_name} ({self._failure}); using the pure-torch reference "
                    "implementations, which give the same results more slowly. Reinstall "
                    "deepshard-kernels from a wheel for this platform, or build it with a C++17 "
                    "compiler (`pip install --force-reinstall deepshard-kernels`).",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return None
            self._apply_env_path(module)
            self._module = module
            return module

    def failure(self) -> str | None:
        """Why the module could not be loaded (``None`` when loaded or not tried yet)."""
        return self._failure

    def _apply_env_path(self, module: CpuExtension) -> None:
        env = os.environ if self._env is None else self._env
        name = env.get(SIMD_ENV_VAR, "").strip()
        if not name:
            return
        try:
            module.set_path(name)
        except ValueError as error:
            raise ValueError(
                f"{SIMD_ENV_VAR}={name!r}: {error}. Usable paths here: "
                f"{', '.join(module.supported_paths())}; unset {SIMD_ENV_VAR} to pick the best."
            ) from None


CPU_EXTENSION = ExtensionLoader("deepshard.kernels._cpu")


def _describe_failure(error: Exception, module_name: str) -> str:
    """Why the extension could not be loaded, in words a user can act on."""
    if isinstance(error, ModuleNotFoundError) and error.name == module_name:
        return (
            f"{type(error).__name__}: {module_name} is not installed: the C++ build failed or "
            "was skipped when deepshard-kernels was installed, so the package was installed "
            "without it (the install log shows the build error)"
        )
    return f"{type(error).__name__}: {error}"
