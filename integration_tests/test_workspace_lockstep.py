"""Every workspace member is released in lockstep and laid out the same way.

The members are found by globbing (``packages/*/pyproject.toml``, plus ``kernels/`` once it
exists), never from a hard-coded list, so a new package is checked the moment it is added. A
member must:

- carry the one workspace version, and pin every sibling it depends on to exactly that version
  (``deepshard-comm==X``) in its published metadata (``dependencies`` and extras; dependency
  groups never leave the workspace, so uv resolves them from ``[tool.uv.sources]``);
- be named after its folder (``packages/<dir>`` ships ``deepshard-<dir>`` and imports as
  ``deepshard.<dir>``, dashes becoming underscores; the meta-package ``packages/deepshard`` ships
  ``deepshard`` and imports as ``deepshard.engine``);
- have a ``README.md``, a ``tests/`` folder with at least one test file, and
  ``src/deepshard/<name>/py.typed``, and never a ``src/deepshard/__init__.py`` (PEP 420);
- be listed in the root ``[tool.uv.sources]`` and ``[tool.mypy] mypy_path``.
"""

from __future__ import annotations

import configparser
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
META_DIR = "deepshard"


@dataclass(frozen=True)
class Member:
    """One workspace member as read from its ``pyproject.toml``."""

    root: Path
    project: dict[str, Any]

    @property
    def rel(self) -> str:
        return self.root.relative_to(REPO).as_posix()

    @property
    def name(self) -> str:
        return str(self.project["name"])

    @property
    def version(self) -> str:
        return str(self.project["version"])

    @property
    def import_name(self) -> str:
        return "engine" if self.root.name == META_DIR else self.root.name.replace("-", "_")

    def published_requirements(self) -> list[Requirement]:
        texts = list(self.project.get("dependencies", []))
        for extra in self.project.get("optional-dependencies", {}).values():
            texts.extend(extra)
        return [Requirement(text) for text in texts]


def _load_toml(path: Path) -> dict[str, Any]:
    with path.open("rb") as handle:
        return tomllib.load(handle)


def _discover_members() -> list[Member]:
    files = sorted(REPO.glob("packages/*/pyproject.toml"))
    kernels = REPO / "kernels" / "pyproject.toml"
    if kernels.is_file():
        files.append(kernels)
    return [Member(path.parent, _load_toml(path)["project"]) for path in files]


MEMBERS = _discover_members()
ROOT = _load_toml(REPO / "pyproject.toml")
IDS = [member.rel for member in MEMBERS]


def _is_sibling(requirement: Requirement) -> bool:
    name = requirement.name.lower().replace("_", "-")
    return name == "deepshard" or name.startswith("deepshard-")


def test_the_workspace_has_members() -> None:
    names = {member.name for member in MEMBERS}
    assert {"deepshard", "deepshard-interface"} <= names, names


def test_every_member_has_the_workspace_version() -> None:
    versions = {member.rel: member.version for member in MEMBERS}
    assert len(set(versions.values())) == 1, f"members disagree on the version: {versions}"


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_siblings_are_pinned_to_the_workspace_version(member: Member) -> None:
    known = {other.name for other in MEMBERS}
    for requirement in member.published_requirements():
        if not _is_sibling(requirement):
            continue
        assert requirement.name in known, f"{member.rel} depends on unknown {requirement.name}"
        pins = [(spec.operator, spec.version) for spec in requirement.specifier]
        assert pins == [("==", member.version)], (
            f"{member.rel}: '{requirement}' must pin exactly '{requirement.name}=={member.version}'"
        )


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_member_is_named_after_its_folder(member: Member) -> None:
    folder = member.root.name
    expected = "deepshard" if folder == META_DIR else f"deepshard-{folder}"
    assert member.name == expected


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_member_layout(member: Member) -> None:
    assert (member.root / "README.md").is_file(), f"{member.rel} has no README.md"
    tests = sorted((member.root / "tests").glob("test_*.py"))
    assert tests, f"{member.rel}/tests has no test_*.py file"
    namespace = member.root / "src" / "deepshard"
    assert not (namespace / "__init__.py").exists(), (
        f"{member.rel}/src/deepshard/__init__.py breaks the PEP 420 namespace: delete it"
    )
    packages = sorted(p.name for p in namespace.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert packages == [member.import_name], (
        f"{member.rel}/src/deepshard must hold exactly one package, {member.import_name}/"
    )
    assert (namespace / member.import_name / "py.typed").is_file()


def test_no_namespace_init_anywhere() -> None:
    skip = {".venv", ".tox", ".git", "site", "build", "dist", "node_modules"}
    offenders = [
        path.relative_to(REPO).as_posix()
        for path in REPO.rglob("deepshard/__init__.py")
        if not skip.intersection(path.relative_to(REPO).parts)
    ]
    assert offenders == []


def test_uv_sources_list_every_member() -> None:
    sources = ROOT["tool"]["uv"]["sources"]
    expected = {member.name: {"workspace": True} for member in MEMBERS}
    declared = {name: spec for name, spec in sources.items() if name.startswith("deepshard")}
    assert declared == expected


def test_workspace_members_cover_every_member() -> None:
    patterns = ROOT["tool"]["uv"]["workspace"]["members"]
    covered = {
        path.parent for pattern in patterns for path in REPO.glob(f"{pattern}/pyproject.toml")
    }
    assert covered == {member.root for member in MEMBERS}


def test_mypy_path_lists_every_member_src() -> None:
    mypy_path = str(ROOT["tool"]["mypy"]["mypy_path"])
    listed = {entry.strip() for entry in mypy_path.replace(",", ":").split(":") if entry.strip()}
    assert listed == {f"{member.rel}/src" for member in MEMBERS}


def test_tox_has_an_env_per_member() -> None:
    # tox.ini names each package env after the member's folder and runs packages/<env>/tests.
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(REPO / "tox.ini")
    env_list = {name.strip() for name in parser["tox"]["env_list"].replace("\n", ",").split(",")}
    folders = {member.root.name for member in MEMBERS if member.root.parent.name == "packages"}
    missing_sections = sorted(f for f in folders if not parser.has_section(f"testenv:{f}"))
    assert missing_sections == [], f"tox.ini lacks [testenv:<name>] for {missing_sections}"
    assert folders <= env_list, f"tox.ini env_list lacks {sorted(folders - env_list)}"


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_docs_have_a_readme_page_and_an_api_page(member: Member) -> None:
    folder = member.root.name
    nav = (REPO / "mkdocs.yml").read_text()
    readme_page = REPO / "docs" / "packages" / f"{folder}.md"
    api_page = REPO / "docs" / "api" / f"{folder}.md"
    assert f'"{member.rel}/README.md"' in readme_page.read_text(), f"{readme_page} must include it"
    assert f"::: deepshard.{member.import_name}" in api_page.read_text()
    for page in (f"packages/{folder}.md", f"api/{folder}.md"):
        assert page in nav, f"mkdocs.yml nav lacks {page}"


_RELATIVE_LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s]+)\)")
# Code is not prose: `x["a"](y)` in an example is a call, not a link.
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


@pytest.mark.parametrize("member", MEMBERS, ids=IDS)
def test_readme_has_no_relative_links(member: Member) -> None:
    # The README is the package's page on the index and in the docs site; a link relative to
    # the repository works in neither. Name the other package or page in plain text instead.
    prose = _CODE.sub("", (member.root / "README.md").read_text())
    links = _RELATIVE_LINK.findall(prose)
    assert links == [], f"{member.rel}/README.md has relative links {links}"
