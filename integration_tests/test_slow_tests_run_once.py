"""The `slow` tests run once in .ci/run (the main run), and every package env still starts ranks.

.ci/run runs the whole suite in the workspace, then one tox env per package, which installs only
that package and what it declares. The package envs deselect the tests marked ``slow`` (over
~3 s: multi-rank, subprocess or daemon heavy), which the main run already ran. This test fails
when that split breaks: the marker is not registered (or not strictly), a package env stops
deselecting it or can no longer select it again (``tox -e zero -- -m ""``), the main run starts
deselecting, or a package whose tests start ranks marks every such test slow, so that its env
would no longer prove its multi-rank code works with only its declared dependencies.
"""

from __future__ import annotations

import ast
import configparser
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
# A test file starts ranks when it runs a mesh, or (the launcher) real ds-launch processes.
_STARTS_RANKS = re.compile(r"\brun_on_mesh\b|\bds_launch\b|--nproc_per_node")


def _pytest_ini() -> dict[str, object]:
    root = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return dict(root["tool"]["pytest"]["ini_options"])


def _tox() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(REPO / "tox.ini", encoding="utf-8")
    return parser


def test_the_marker_is_registered_strictly() -> None:
    ini = _pytest_ini()
    assert "--strict-markers" in str(ini["addopts"]).split()
    markers = ini["markers"]
    assert isinstance(markers, list) and any(str(line).startswith("slow:") for line in markers)


def test_package_envs_deselect_slow_tests_and_posargs_can_select_them() -> None:
    tox = _tox()
    for section in ("testenv", "testenv:kernels"):
        command = tox[section]["commands"].strip()
        assert command.startswith('pytest -m "not slow" {posargs} '), (section, command)


def test_the_main_run_selects_every_test() -> None:
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    main_run = re.findall(r"^\s*uv run --all-packages pytest\b(.*)$", ci, re.MULTILINE)
    assert main_run, "no main pytest run found in .ci/run"
    assert all(" -m" not in rest for rest in main_run), main_run


def _is_slow(node: ast.expr) -> bool:
    return ast.unparse(node).replace(" ", "") in {"pytest.mark.slow", "mark.slow"}


def _unmarked_tests(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in statement.targets
        ):
            value = statement.value
            marks = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
            if any(_is_slow(mark) for mark in marks):
                return []
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and node.name.startswith("test")
        and not any(_is_slow(d) for d in node.decorator_list)
    ]


def _test_dirs() -> list[Path]:
    return [*sorted(REPO.glob("packages/*/tests")), REPO / "kernels" / "tests"]


@pytest.mark.parametrize("tests", _test_dirs(), ids=lambda p: p.parent.name)
def test_a_package_that_starts_ranks_keeps_one_such_test_in_its_env(tests: Path) -> None:
    multi_rank = [
        path
        for path in sorted(tests.glob("test_*.py"))
        if _STARTS_RANKS.search(path.read_text(encoding="utf-8"))
    ]
    if not multi_rank:
        return  # nothing of this package starts ranks
    kept = {path.name: names for path in multi_rank if (names := _unmarked_tests(path))}
    assert kept, (
        f"every test of {tests.parent.name} that starts ranks is marked slow, so its tox env no "
        "longer runs one; unmark the cheapest (see `pytest --durations`)"
    )
