"""Importing a helper module that sits beside a test file.

pytest runs with ``--import-mode=importlib``, which keeps ``tests/`` folders off ``sys.path``,
so a test cannot ``import _models``. `import_beside` loads the file by path once per process
and registers it under a name derived from that path, so every test file of a folder (and a
rank process that re-loads the test module) shares one module object.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["import_beside"]


def import_beside(test_file: str | Path, name: str) -> ModuleType:
    """The module in file ``name`` of ``test_file``'s folder, loaded once per process.

    Args:
        test_file: The calling test's ``__file__``.
        name: The helper's file name, e.g. ``"_models.py"``.

    Raises:
        FileNotFoundError: No such file beside the test.
    """
    path = Path(test_file).resolve().with_name(name)
    if not path.is_file():
        raise FileNotFoundError(f"import_beside: no {name} beside {test_file}")
    key = "_deepshard_beside_" + re.sub(r"\W", "_", str(path.with_suffix("")))
    module = sys.modules.get(key)
    if module is None:
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return module
