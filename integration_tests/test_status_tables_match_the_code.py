"""The README and the docs show the status tables the engine reads, and the tables are true.

`deepshard.interface.status` is the one source: the engine refuses its planned rows and reports
its ignored ones; ``tools/status_tables.py`` writes them between markers into README.md,
docs/index.md and the config reference. This test fails when a file and the tables disagree
(fix: ``uv run --all-packages python tools/status_tables.py``), and when the package table
claims a package the workspace does not have, or misses one it has.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from deepshard.interface.status import FEATURES, PACKAGES

REPO = Path(__file__).resolve().parent.parent


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_status_tables", REPO / "tools" / "status_tables.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_and_docs_match_the_tables() -> None:
    assert _tool().stale_files() == [], "run: uv run --all-packages python tools/status_tables.py"


def test_a_changed_table_makes_the_readme_stale(tmp_path: Path) -> None:
    tool = _tool()
    for relative in tool.REGIONS:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        text = (REPO / relative).read_text()
        (tmp_path / relative).write_text(text.replace("| partial |", "| available |", 1))
    assert tool.stale_files(tmp_path) == ["README.md", "docs/index.md"]


def _workspace() -> dict[str, str]:
    """Distribution name -> folder, from the members' own pyproject files."""
    found = {}
    for pyproject in [*REPO.glob("packages/*/pyproject.toml"), REPO / "kernels/pyproject.toml"]:
        if pyproject.is_file():
            name = tomllib.loads(pyproject.read_text())["project"]["name"]
            found[name] = str(pyproject.parent.relative_to(REPO))
    return found


def test_the_package_table_is_the_workspace() -> None:
    workspace = _workspace()
    installable = {p.distribution: p.folder for p in PACKAGES if p.status != "planned"}
    assert installable == workspace
    for package in PACKAGES:
        assert (package.folder is None) == (package.status == "planned"), package.distribution


def test_every_installable_package_has_a_docs_page() -> None:
    for package in PACKAGES:
        if package.folder is not None:
            page = REPO / "docs" / "packages" / f"{package.folder.rsplit('/', 1)[-1]}.md"
            assert page.is_file(), f"{package.distribution}: no {page.relative_to(REPO)}"


def test_rows_of_the_feature_table_name_real_packages() -> None:
    names = {package.distribution for package in PACKAGES}
    for row in FEATURES:
        assert row.package is None or row.package in names, row.key


def test_the_config_reference_notes_each_covered_field() -> None:
    notes = _tool().field_notes()
    lr_schedule = notes[("RandomLtdLrScheduleConfig", "enabled")]
    assert lr_schedule.startswith("**Status: planned**")
    assert "consumed layer-tokens" in lr_schedule
    assert ("Bf16Config", "bf16_master_weights_and_grads") not in notes  # runs at stages 1-3
    assert ("Fp16Config", "fp16_master_weights_and_grads") not in notes  # runs with offload
    assert ("ZeroConfig", "offload_param") not in notes  # ZeRO-3 parameter offload runs
    assert ("ZeroConfig", "stage") not in notes  # stage 3 runs: no note
    assert notes[("TensorBoardConfig", "output_path")].startswith("**Status: accepted, ignored**")
    assert ("ZeroConfig", "reduce_bucket_size") not in notes  # available: no note
    assert ("MoeConfig", "ep_size") not in notes  # an available row under an ignored section
    planned_fields = {row.key for row in FEATURES if row.status == "planned"}
    noted = sum(note.startswith("**Status: planned**") for note in notes.values())
    assert noted >= len(planned_fields)  # each planned key's field, and the fields under it


def test_the_migration_guide_groups_every_key_once() -> None:
    tool = _tool()
    keys = list(tool._leaf_keys())
    text = tool.migration_tables()
    supported, different, refused = text.split("\n### ")
    counts = [int(part.split(" keys)")[0].rsplit("(", 1)[1]) for part in text.split("### ")[1:]]
    assert sum(counts) == len(keys) == len(set(keys))
    lr_key = "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled"
    assert f"| `{lr_key}` |" in refused  # planned: refused when true
    assert "`bf16_optimizer_states`" in supported.split("| `bf16` |")[1].split("\n")[0]
    assert "| `sparse_gradients` |" in different  # runs; its bandwidth saving does not
    assert "| `checkpoint.load_universal` |" in different  # accepted, no effect
    assert "`stage`" in supported.split("| `zero_optimization` |")[1].split("\n")[0]
    for key in keys:
        if key.startswith("tensorboard."):
            assert f"| `{key}` |" in different, key  # the whole section is ignored today
