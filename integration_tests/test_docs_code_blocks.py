"""Every code block of the docs and the READMEs runs as printed.

* Each ```python block of ``docs/**/*.md``, ``README.md`` and the package READMEs is run,
  except a package README's *first* block: the package's own ``tests/test_*readme*.py`` runs
  that one (checked here, so a README losing its test is caught, not silently unrun).
* A block preceded by ``<!-- doctest: skip (why) -->`` is reported as skipped with that reason
  (it shows in pytest's ``-rs`` summary); nothing else is left out.
* Blocks that start processes (``run_on_mesh``, ``torch.multiprocessing``) run as their own
  script, since the ranks import their code from ``__main__``; all the other blocks run one
  after another in a single interpreter (importing torch once is most of the cost), each in a
  fresh namespace and temporary working directory, with any process group torn down between.
* Each ```bash line of the guides and the migration guide names a known command; ``ds-launch``
  and ``ds-checkpoint`` lines are parsed by their own argument parsers. (README.md's and
  docs/installation.md's commands are checked by ``test_readme_commands_work_as_printed.py``.)

About 40-70 s in all on 2 busy cores, nearly all of it importing torch and the engine.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```", flags=re.S | re.M)
_SKIP = re.compile(r"<!-- doctest: skip \((.+?)\) -->\s*$")
_OWN_PROCESS = ("run_on_mesh", "torch.multiprocessing", "mp.start_processes")
_KNOWN_COMMANDS = {"ds-launch", "ds-checkpoint", "uv", "python"}
_BASH_PAGES = ("docs/migration.md", "docs/guides")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a markdown file."""

    page: str
    """The file, relative to the repository root."""

    line: int
    """The line of its opening fence (1-based)."""

    language: str
    """The fence's language word (``python``, ``bash``)."""

    code: str
    """The block's text, without the fences."""

    skip: str | None
    """The reason of a ``<!-- doctest: skip (...) -->`` right above it, else None."""

    @property
    def name(self) -> str:
        """``page:line``, the block's test id."""
        return f"{self.page}:{self.line}"


def _pages() -> list[Path]:
    readmes = [REPO / "README.md", *REPO.glob("packages/*/README.md"), REPO / "kernels/README.md"]
    return sorted({*REPO.glob("docs/**/*.md"), *(p for p in readmes if p.is_file())})


def blocks_of(text: str, page: str) -> list[Block]:
    """Every fenced block of ``text`` with its skip annotation (the line above the fence)."""
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match[1], match[2], skip[1] if skip else None))
    return found


def _readme_test(page: Path) -> Path | None:
    """The package test that runs ``page``'s first python block, if the page is a README."""
    if page.name != "README.md" or page.parent == REPO:
        return None
    tests = sorted((page.parent / "tests").glob("test_*readme*.py"))
    return tests[0] if tests else None


@functools.cache
def all_blocks() -> tuple[tuple[Block, ...], tuple[tuple[Block, Path], ...]]:
    """``(blocks run here, (block, test) pairs of README blocks their package test runs)``."""
    mine: list[Block] = []
    folded: list[tuple[Block, Path]] = []
    for page in _pages():
        found = blocks_of(page.read_text(), str(page.relative_to(REPO)))
        python = [b for b in found if b.language == "python"]
        test = _readme_test(page)
        if test is not None and python:
            folded.append((python.pop(0), test))
        mine += python
    return tuple(mine), tuple(folded)


_RUNNER = """
import json, os, runpy, sys, tempfile, traceback
for path in sys.argv[1:]:
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as work:
        os.chdir(work)
        try:
            runpy.run_path(path, run_name="__main__")
            error = None
        except BaseException:
            error = traceback.format_exc()
        finally:
            os.chdir(here)
            dist = sys.modules.get("torch.distributed")  # a block's world must not leak
            if dist is not None and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    print("@@doctest " + json.dumps({"path": path, "error": error}), flush=True)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _write(block: Block, folder: Path) -> Path:
    path = folder / (re.sub(r"\W", "_", block.name) + ".py")
    path.write_text(block.code)
    return path


def run_shared(blocks: list[Block], folder: Path) -> dict[str, str | None]:
    """Block name -> traceback (None: it passed), running ``blocks`` in one interpreter."""
    paths = {str(_write(b, folder)): b.name for b in blocks}
    run = subprocess.run(
        [sys.executable, "-c", _RUNNER, *paths], cwd=folder, env=_env(),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    results: dict[str, str | None] = {}
    for line in run.stdout.splitlines():
        if line.startswith("@@doctest "):
            record = json.loads(line.removeprefix("@@doctest "))
            results[paths[record["path"]]] = record["error"]
    tail = (run.stdout + run.stderr)[-3000:]
    return {name: results.get(name, f"did not finish (exit {run.returncode}):\n{tail}")
            for name in paths.values()}  # fmt: skip


@pytest.fixture(scope="module")
def shared_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """`run_shared` over every block that runs in the shared interpreter."""
    shared = [b for b in all_blocks()[0] if b.skip is None and not _own_process(b)]
    return run_shared(shared, tmp_path_factory.mktemp("doc_blocks"))


def test_the_runner_reports_a_failing_block_and_isolates_the_next(tmp_path: Path) -> None:
    bad = Block("bad.md", 1, "python", "leaked = 1\nraise ValueError('wrong')\n", None)
    good = Block("good.md", 1, "python", "assert 'leaked' not in globals()\n", None)
    results = run_shared([bad, good], tmp_path)
    assert "ValueError: wrong" in (results["bad.md:1"] or "")
    assert results["good.md:1"] is None


def _own_process(block: Block) -> bool:
    return any(word in block.code for word in _OWN_PROCESS)


@pytest.mark.parametrize("block", all_blocks()[0], ids=lambda b: b.name)
def test_python_block_runs(
    block: Block, shared_results: dict[str, str | None], tmp_path: Path
) -> None:
    if block.skip is not None:
        pytest.skip(f"{block.name} annotated: {block.skip}")
    if not _own_process(block):
        error = shared_results[block.name]
        assert error is None, f"{block.name} failed:\n{error}"
        return
    run = subprocess.run(
        [sys.executable, str(_write(block, tmp_path))], cwd=tmp_path, env=_env(),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, f"{block.name} failed:\n{(run.stdout + run.stderr)[-3000:]}"


@pytest.mark.parametrize(("block", "test"), all_blocks()[1], ids=lambda v: getattr(v, "name", ""))
def test_first_readme_block_is_run_by_its_package_test(block: Block, test: Path) -> None:
    assert "README" in test.read_text(), f"{test} no longer reads {block.page}"


def test_the_collector_finds_the_guides_and_the_annotations() -> None:
    names = [b.name for b in all_blocks()[0]]
    assert any(name.startswith("docs/guides/") for name in names)
    assert any(name.startswith("docs/migration.md") for name in names)
    text = "x\n<!-- doctest: skip (needs 2 GPUs) -->\n```python\nboom()\n```\n```python\nok\n```\n"
    skipped, kept = blocks_of(text, "page.md")
    assert (skipped.skip, skipped.line, kept.skip) == ("needs 2 GPUs", 3, None)


def _bash_lines() -> list[tuple[str, str]]:
    found = []
    for page in _pages():
        relative = str(page.relative_to(REPO))
        if not relative.startswith(_BASH_PAGES):
            continue
        for block in blocks_of(page.read_text(), relative):
            if block.language != "bash":
                continue
            if block.skip is not None:
                found.append((block.name, f"# doctest: skip ({block.skip})"))
                continue
            found += [(block.name, ln.strip()) for ln in block.code.splitlines() if ln.strip()]
    return found


@pytest.mark.parametrize(("where", "command"), _bash_lines())
def test_bash_line_is_a_known_command(where: str, command: str) -> None:
    if command.startswith("# doctest: skip"):
        pytest.skip(f"{where} annotated: {command.removeprefix('# doctest: skip ')}")
    words = shlex.split(command)
    assert words[0] in _KNOWN_COMMANDS, f"{where}: `{words[0]}` is not a command the docs know"
    if words[0] == "ds-launch":
        from deepshard.launcher.cli import parse_args

        parse_args(words[1:])  # exits (SystemExit 2) on a flag ds-launch does not have
    if words[0] == "ds-checkpoint":
        from deepshard.checkpoint.cli import build_parser

        build_parser().parse_args(words[1:])  # the same for ds-checkpoint's subcommands


def test_the_bash_check_catches_a_wrong_flag() -> None:
    from deepshard.launcher.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--no_such_flag", "train.py"])


def test_every_guide_is_in_the_site_nav() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    for guide in sorted((REPO / "docs" / "guides").glob("*.md")):
        assert f"guides/{guide.name}" in nav, f"mkdocs.yml nav lacks guides/{guide.name}"
    assert "migration.md" in nav
