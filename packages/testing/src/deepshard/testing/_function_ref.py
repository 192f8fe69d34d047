"""Ship a module-level function to a child process that may not be able to import it by name.

pytest's ``--import-mode=importlib`` loads a test file under a name derived from its path, which
is usually not importable in a fresh process. So the parent sends (source file, module name,
qualified name), and the child loads the file under that same name, registers it in
``sys.modules`` (so that pickled objects defined in the test module resolve), then looks the
function up. A module that is already present in the child (``__main__``, which multiprocessing
prepares itself, or a preloaded library module) is used as is.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from deepshard.interface.errors import ConfigError

__all__ = ["FunctionRef", "function_ref", "resolve_function"]


@dataclasses.dataclass(frozen=True)
class FunctionRef:
    """Where to find a module-level function in another process.

    Attributes:
        module: ``fn.__module__`` as the parent knows it.
        qualname: ``fn.__qualname__``; dotted for a static method of a module-level class.
        file: The module's source file, or ``None`` when it has none.
    """

    module: str
    qualname: str
    file: str | None


def function_ref(fn: Callable[..., Any]) -> FunctionRef:
    """Describe ``fn`` so that `resolve_function` can find it in a child process.

    Raises:
        ConfigError: ``fn`` is a lambda, a nested function or has no module.
    """
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module_name or not qualname or "<" in qualname:
        raise ConfigError(
            f"run_on_mesh needs a module-level function, got {fn!r}: lambdas and functions "
            "defined inside another function cannot be found by the rank processes; "
            "move it to the top level of the test module"
        )
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None) if module is not None else None
    return FunctionRef(module=module_name, qualname=qualname, file=file)


def _load_module(ref: FunctionRef) -> ModuleType:
    present = sys.modules.get(ref.module)
    if present is not None and (ref.module == "__main__" or _same_file(present, ref.file)):
        return present
    if ref.file is None or not os.path.exists(ref.file):
        return importlib.import_module(ref.module)
    spec = importlib.util.spec_from_file_location(ref.module, ref.file)
    if spec is None or spec.loader is None:
        return importlib.import_module(ref.module)
    module = importlib.util.module_from_spec(spec)
    _ensure_parents(ref.module)
    sys.modules[ref.module] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[ref.module]
        raise
    return module


def _ensure_parents(name: str) -> None:
    """Make ``a`` and ``a.b`` present for ``a.b.c``, as pytest does for test modules.

    ``pickle`` imports a class's module with ``__import__``, which imports every parent package
    first; a path-derived test module name usually has parents that exist nowhere.
    """
    parts = name.split(".")
    for depth in range(1, len(parts)):
        parent = ".".join(parts[:depth])
        if parent in sys.modules:
            continue
        try:
            importlib.import_module(parent)
        except ImportError:
            placeholder = ModuleType(parent, "placeholder parent of a test module")
            placeholder.__path__ = []
            sys.modules[parent] = placeholder


def _same_file(module: ModuleType, file: str | None) -> bool:
    present: str | None = getattr(module, "__file__", None)
    if present is None or file is None:
        return present is None and file is None
    return os.path.realpath(present) == os.path.realpath(file)


def resolve_function(ref: FunctionRef) -> Callable[..., Any]:
    """Load (or find) the module named by ``ref`` and return the function it names."""
    target: Any = _load_module(ref)
    for part in ref.qualname.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{ref.module}.{ref.qualname} is {type(target).__name__}, not callable")
    return target  # type: ignore[no-any-return]
