"""`run_readme_example` runs a README's first python block in a clean world and reports failures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deepshard.testing import ReadmeExampleError, readme_example_code, run_readme_example

_PRINT_ENV = """
import os
print(os.environ.get("RANK"), os.environ.get("SLURM_PROCID"), os.environ["OMP_NUM_THREADS"])
print(os.environ.get("EXTRA"), os.getcwd())
"""


def _readme(tmp_path: Path, *blocks: str) -> Path:
    readme = tmp_path / "README.md"
    body = "\n".join(f"```python\n{block.lstrip()}```\n" for block in blocks)
    readme.write_text(f"# pkg\n\n```bash\npip install pkg\n```\n\n{body}", encoding="utf-8")
    return readme


@pytest.mark.parametrize("in_process", [False, True])
def test_the_first_block_runs_without_launcher_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_process: bool
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    readme = _readme(tmp_path, _PRINT_ENV, "print('second block')")
    out = run_readme_example(readme, env={"EXTRA": "yes"}, in_process=in_process)
    first, second = out.splitlines()
    assert first == "None None 1"
    assert second.startswith("yes ")
    assert "second block" not in out
    # The test's own environment is untouched afterwards.
    assert (os.environ["RANK"], os.environ["OMP_NUM_THREADS"]) == ("3", "8")
    assert "EXTRA" not in os.environ


def test_a_fresh_interpreter_runs_in_the_given_folder(tmp_path: Path) -> None:
    readme = _readme(tmp_path, "open('made.txt', 'w').write('x')\nprint('done')")
    work = tmp_path / "work"
    work.mkdir()
    assert run_readme_example(readme, cwd=work) == "done\n"
    assert (work / "made.txt").read_text() == "x"


@pytest.mark.parametrize("in_process", [False, True])
def test_a_failing_example_names_the_readme_and_the_error(tmp_path: Path, in_process: bool) -> None:
    readme = _readme(tmp_path, "raise ValueError('the example broke')")
    with pytest.raises(ReadmeExampleError, match="the example broke") as caught:
        run_readme_example(readme, in_process=in_process)
    assert str(readme.resolve()) in str(caught.value)


def test_an_example_past_its_time_limit_fails(tmp_path: Path) -> None:
    readme = _readme(tmp_path, "import time\ntime.sleep(30)")
    with pytest.raises(ReadmeExampleError, match=r"ran past 0\.5 s"):
        run_readme_example(readme, timeout_s=0.5)


def test_a_readme_without_a_python_block_is_refused(tmp_path: Path) -> None:
    readme = _readme(tmp_path)
    with pytest.raises(ReadmeExampleError, match="has no ```python block"):
        readme_example_code(readme)
    assert readme_example_code(_readme(tmp_path, "x = 1\n", "y = 2\n")) == "x = 1\n"
