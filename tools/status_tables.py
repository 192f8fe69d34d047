"""Write the status tables of `deepshard.interface.status` into the README and the docs.

The feature and package tables in `deepshard.interface.status` are what the engine refuses and
warns from; this script renders them as markdown between markers in the files below, so the
documentation says exactly what the code does. It imports only `deepshard.interface` (no torch).

    <!-- status:NAME -->            (generated, do not edit by hand)
    ...
    <!-- /status:NAME -->

``python tools/status_tables.py`` rewrites the regions; ``--check`` exits 1 when a file differs
(``integration_tests/test_status_tables_match_the_code.py`` runs the same comparison). The docs'
per-key notes in the config reference come from `field_notes`, applied at build time by the
griffe extension ``docs/hooks/config_status.py``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import BaseModel

from deepshard.interface.config import DeepShardConfig
from deepshard.interface.config._keys import json_key, unwrap_optional
from deepshard.interface.status import FEATURES, PACKAGES, FeatureStatus, status_of

REPO = Path(__file__).resolve().parent.parent

_STATUS_WORDS = {
    "available": "available",
    "planned": "planned: refused when asked for",
    "ignored": "accepted, ignored (reported on rank 0)",
}


def _package_table(link: Callable[[str], str]) -> str:
    rows = ["| package | import | what it owns | status |", "| --- | --- | --- | --- |"]
    for package in PACKAGES:
        name = package.distribution
        if package.folder is not None:
            name = f"[{name}]({link(package.folder)})"
        rows.append(f"| {name} | `{package.import_name}` | {package.summary} | {package.status} |")
    return "\n".join(rows)


def readme_packages() -> str:
    """The README's package table, linking each package's folder."""
    return _package_table(lambda folder: folder)


def docs_packages() -> str:
    """The docs index's package table, linking each package's page."""
    return _package_table(lambda folder: f"packages/{folder.rsplit('/', 1)[-1]}.md")


def planned_summary() -> str:
    """One line per planned feature (refused until it lands), with the package bringing it."""
    seen: dict[str, str] = {}
    for row in FEATURES:
        if row.status == "planned":
            seen.setdefault(row.feature.split(" (")[0], row.package or "")
    return "\n".join(f"- {feature} ({package})" for feature, package in seen.items())


def _owner(row: FeatureStatus) -> str:
    return row.package or "none (no effect by design)"


def feature_table() -> str:
    """Every row of the feature table: key, when it counts as asked for, status, feature."""
    rows = [
        "| key | asked for when | status | feature | brought by |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in FEATURES:
        rows.append(
            f"| `{row.key}` | {row.when.describe()} | {_STATUS_WORDS[row.status]} | "
            f"{row.feature} | {_owner(row)} |"
        )
    return "\n".join(rows)


def _sections(model: type[BaseModel], prefix: str) -> Iterator[tuple[type[BaseModel], str]]:
    yield model, prefix
    for name, info in model.model_fields.items():
        for member in unwrap_optional(info.annotation):
            if isinstance(member, type) and issubclass(member, BaseModel):
                yield from _sections(member, f"{prefix}{json_key(name, info)}.")


def field_notes() -> dict[tuple[str, str], str]:
    """``(class name, field name) -> note`` for every config field a non-available row covers.

    The note is one markdown line for the top of the field's docstring in the config reference,
    e.g. ``**Status: planned** (refused when `3`): ZeRO stage 3, deepshard-zero.`` Fields are
    listed under every class that declares or inherits them.
    """
    notes = {}
    for model, prefix in _sections(DeepShardConfig, ""):
        for klass in model.__mro__:
            fields = getattr(klass, "__annotations__", {})
            for name, info in model.model_fields.items():
                if name not in fields:
                    continue
                row = status_of(f"{prefix}{json_key(name, info)}")
                if row is None or row.status == "available":
                    continue
                notes[(klass.__name__, name)] = _note(row)
    return notes


def _leaf_keys() -> Iterator[str]:
    """Every DeepSpeed key path of the schema that holds a value (not a section)."""
    for model, prefix in _sections(DeepShardConfig, ""):
        for name, info in model.model_fields.items():
            members = unwrap_optional(info.annotation)
            if not any(isinstance(m, type) and issubclass(m, BaseModel) for m in members):
                yield f"{prefix}{json_key(name, info)}"


_MIGRATION_TITLES = {
    "available": "Supported: runs as in DeepSpeed",
    "ignored": "Different: accepted, but no effect yet (reported once on rank 0)",
    "planned": "Refused: `initialize` raises a `ConfigError` naming the key",
}


def _supported_rows(keys: list[str]) -> list[str]:
    """One row per top-level section: its supported keys, in schema order."""
    sections: dict[str, list[str]] = {}
    for key in keys:
        section, _, rest = key.partition(".")
        sections.setdefault(section if rest else "(top level)", []).append(f"`{rest or key}`")
    return [f"| `{name}` | {', '.join(names)} |" for name, names in sections.items()]


def migration_tables() -> str:
    """Every config key of the schema, grouped by what DeepShard does with it today.

    A key no row covers (or an ``available`` row covers) is supported; the others sit under
    their row's status with the condition that makes a config ask for it.
    """
    supported: list[str] = []
    other: dict[str, list[str]] = {"ignored": [], "planned": []}
    for key in _leaf_keys():
        row = status_of(key)
        if row is None or row.status == "available":
            supported.append(key)
        else:
            line = f"| `{key}` | {row.when.describe()} | {row.feature} | {_owner(row)} |"
            other[row.status].append(line)
    head = "| key | asked for when | feature | brought by |\n| --- | --- | --- | --- |"
    parts = [
        f"### {_MIGRATION_TITLES['available']} ({len(supported)} keys)\n\n"
        "| section | keys |\n| --- | --- |\n" + "\n".join(_supported_rows(supported))
    ]
    for status, rows in other.items():
        parts.append(
            f"### {_MIGRATION_TITLES[status]} ({len(rows)} keys)\n\n{head}\n" + "\n".join(rows)
        )
    return "\n\n".join(parts)


def _note(row: FeatureStatus) -> str:
    if row.status == "planned":
        head = f"**Status: planned** (refused when {row.when.describe()}, at `{row.key}`)"
    else:
        head = f"**Status: accepted, ignored** (when {row.when.describe()}, at `{row.key}`)"
    return f"{head}: {row.feature}; {_owner(row)}."


REGIONS: dict[str, dict[str, Callable[[], str]]] = {
    "README.md": {"packages": readme_packages, "planned": planned_summary},
    "docs/index.md": {"packages": docs_packages, "planned": planned_summary},
    "docs/api/interface-config.md": {"features": feature_table},
    "docs/migration.md": {"migration": migration_tables},
}
"""File (from the repository root) -> region name -> what fills it."""


def render(text: str, regions: dict[str, Callable[[], str]], *, where: str) -> str:
    """``text`` with every named region replaced by its generated content.

    Raises:
        SystemExit: A region's markers are missing from the file.
    """
    for name, make in regions.items():
        pattern = re.compile(rf"(<!-- status:{name} -->\n).*?(<!-- /status:{name} -->)", flags=re.S)
        if not pattern.search(text):
            raise SystemExit(
                f"{where}: the markers <!-- status:{name} --> ... <!-- /status:{name} --> are "
                "missing; put them back where the generated table belongs"
            )
        text = pattern.sub(rf"\g<1>{_escape(make())}\n\g<2>", text)
    return text


def _escape(replacement: str) -> str:
    """A literal ``re.sub`` replacement (backslashes in the markdown stay as written)."""
    return replacement.replace("\\", "\\\\")


def stale_files(root: Path = REPO) -> list[str]:
    """The files whose generated regions differ from the tables."""
    stale = []
    for relative, regions in REGIONS.items():
        text = (root / relative).read_text()
        if render(text, regions, where=relative) != text:
            stale.append(relative)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = parser.parse_args(argv)
    stale = stale_files()
    if args.check:
        for relative in stale:
            print(f"{relative}: stale; run `uv run --all-packages python tools/status_tables.py`")
        return 1 if stale else 0
    for relative in stale:
        path = REPO / relative
        path.write_text(render(path.read_text(), REGIONS[relative], where=relative))
        print(f"rewrote {relative}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
