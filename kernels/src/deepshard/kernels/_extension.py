"""Lazy loading of the compiled extensions (CPU and CUDA), with one warning when one is missing.

Importing deepshard.kernels loads nothing; the first op call (or report) imports an extension.
When that import fails (no build for this platform, a broken build, a missing symbol), the ops
fall back to their pure-torch twins and exactly one ``RuntimeWarning`` says why. One loader class
serves both modules: `ExtensionLoader.load` imports silently (for reports), `ExtensionLoader.get`
also warns once. After a successful import of the CPU module the SIMD path named by
``DEEPSHARD_CPU_SIMD``, if set, is made active.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar, cast

__all__ = [
    "CPU_EXTENSION",
    "CUDA_EXTENSION",
    "SIMD_ENV_VAR",
    "CpuExtension",
    "ExtensionLoader",
    "cpu_loader",
]

SIMD_ENV_VAR = "DEEPSHARD_CPU_SIMD"

_CPU_HINT = (
    "Reinstall deepshard-kernels from a wheel for this platform, or build it with a C++17 "
    "compiler (`pip install --force-reinstall deepshard-kernels`)."
)
_CUDA_HINT = (
    "It is built only when a CUDA compiler is found while deepshard-kernels is installed: put "
    "nvcc on PATH (or set CUDACXX) and reinstall deepshard-kernels."
)

ModuleT = TypeVar("ModuleT")


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


class ExtensionLoader(Generic[ModuleT]):
    """Imports a compiled module on first use and remembers the outcome.

    Args:
        module: Dotted name of the compiled module.
        env: Environment to read ``DEEPSHARD_CPU_SIMD`` from; ``None`` means ``os.environ``.
        hint: What a user does to get the module, appended to the failure warning.
        on_load: Called once with the freshly imported module (the CPU loader applies
            ``DEEPSHARD_CPU_SIMD`` here); ``None`` for nothing.
        importer: Builds the module instead of importing ``module`` (the MPS ops compile their
            Metal source this way); it raises ImportError, OSError or RuntimeError when it
            cannot.
    """

    def __init__(
        self,
        module: str,
        env: Mapping[str, str] | None = None,
        *,
        hint: str = _CPU_HINT,
        on_load: Callable[[ModuleT, Mapping[str, str]], None] | None = None,
        importer: Callable[[], ModuleT] | None = None,
    ) -> None:
        self._module_name = module
        self._importer = importer
        self._env = env
        self._hint = hint
        self._on_load = on_load
        self._lock = threading.Lock()
        self._module: ModuleT | None = None
        self._failure: str | None = None
        self._warned = False

    @property
    def module_name(self) -> str:
        """Dotted name of the compiled module."""
        return self._module_name

    def load(self) -> ModuleT | None:
        """Returns the loaded module, or ``None`` when it cannot be loaded; never warns.

        Raises:
            ValueError: ``on_load`` refused the module (e.g. a bad ``DEEPSHARD_CPU_SIMD``).
        """
        with self._lock:
            if self._module is not None or self._failure is not None:
                return self._module
            try:
                if self._importer is not None:
                    module = self._importer()
                else:
                    module = cast(ModuleT, importlib.import_module(self._module_name))
            except (ImportError, OSError, RuntimeError) as error:
                self._failure = _describe_failure(error, self._module_name)
                return None
            if self._on_load is not None:
                self._on_load(module, os.environ if self._env is None else self._env)
            self._module = module
            return module

    def get(self) -> ModuleT | None:
        """As `load`, but the first time the module is missing one ``RuntimeWarning`` says why.

        Raises:
            ValueError: As `load`.
        """
        module = self.load()
        with self._lock:
            if module is not None or self._warned:
                return module
            self._warned = True
        warnings.warn(
            f"deepshard.kernels: cannot load the compiled extension {self._module_name} "
            f"({self._failure}); using the pure-torch reference implementations, which give "
            f"the same results more slowly. {self._hint}",
            RuntimeWarning,
            stacklevel=4,
        )
        return None

    def failure(self) -> str | None:
        """Why the module could not be loaded (``None`` when loaded or not tried yet)."""
        return self._failure

    def failure_with_hint(self) -> str:
        """Why the module is missing and how to get it (loading it first if need be)."""
        self.load()
        return f"{self._module_name} could not be loaded ({self._failure}). {self._hint}"


def _apply_env_path(module: CpuExtension, env: Mapping[str, str]) -> None:
    """Makes the SIMD path named by ``DEEPSHARD_CPU_SIMD`` active, if the variable is set."""
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


def cpu_loader(module: str, env: Mapping[str, str] | None = None) -> ExtensionLoader[CpuExtension]:
    """A loader of a CPU extension module that applies ``DEEPSHARD_CPU_SIMD`` once loaded."""
    return ExtensionLoader(module, env, hint=_CPU_HINT, on_load=_apply_env_path)


CPU_EXTENSION = cpu_loader("deepshard.kernels._cpu")
CUDA_EXTENSION: ExtensionLoader[Any] = ExtensionLoader("deepshard.kernels._cuda", hint=_CUDA_HINT)
"""The multi-tensor CUDA module (csrc/cuda); its functions are typed by their use sites."""


def _describe_failure(error: Exception, module_name: str) -> str:
    """Why the extension could not be loaded, in words a user can act on."""
    if isinstance(error, ModuleNotFoundError) and error.name == module_name:
        return (
            f"{type(error).__name__}: {module_name} is not installed: the C++ build failed or "
            "was skipped when deepshard-kernels was installed, so the package was installed "
            "without it (the install log shows the build error)"
        )
    return f"{type(error).__name__}: {error}"
