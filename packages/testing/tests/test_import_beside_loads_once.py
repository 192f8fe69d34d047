"""``import_beside`` loads a helper next to a test file once, under a name derived from its path."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepshard.testing import import_beside


def test_a_helper_beside_the_test_is_loaded_once(tmp_path: Path) -> None:
    (tmp_path / "_helper.py").write_text("LOADS = []\nLOADS.append(1)\n")
    test_file = tmp_path / "test_something.py"
    first = import_beside(test_file, "_helper.py")
    again = import_beside(str(test_file), "_helper.py")
    assert first is again
    assert first.LOADS == [1]


def test_helpers_of_two_folders_stay_apart(tmp_path: Path) -> None:
    for folder, value in (("a", 1), ("b", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "_helper.py").write_text(f"VALUE = {value}\n")
    a = import_beside(tmp_path / "a" / "test_x.py", "_helper.py")
    b = import_beside(tmp_path / "b" / "test_x.py", "_helper.py")
    assert (a.VALUE, b.VALUE) == (1, 2)


def test_a_missing_helper_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"_absent\.py"):
        import_beside(tmp_path / "test_x.py", "_absent.py")
