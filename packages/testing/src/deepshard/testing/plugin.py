"""pytest plugin of ``deepshard-testing`` (registered through the ``pytest11`` entry point).

Fixtures:
    run_on_mesh: `deepshard.testing.run_on_mesh` with ``store_dir`` bound to the test's
        ``tmp_path``, so each test's FileStore and rank logs stay with the test.

Loading the plugin imports neither torch nor ``deepshard.comm``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deepshard.testing._run_on_mesh import run_on_mesh as _run_on_mesh

__all__ = ["run_on_mesh"]


@pytest.fixture
def run_on_mesh(tmp_path: Path) -> Callable[..., list[Any]]:
    """``run_on_mesh(fn, world_size, ...)`` with its FileStore in this test's ``tmp_path``."""
    return functools.partial(_run_on_mesh, store_dir=tmp_path)
