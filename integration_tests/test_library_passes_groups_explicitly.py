"""DeepShard's own packages never rely on the default group: every collective names its group.

`deepshard.comm`'s collectives default to the world group for users (as `torch.distributed`
does), but library code runs on sub-meshes (dp, tp, ep, ...) where the world is the wrong group.
This reads every `packages/*/src` module and fails on a call of a collective without `group=`.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_to_all_single",
        "broadcast",
        "barrier",
    }
)


def _calls_without_group(path: Path, root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in COLLECTIVES:
            continue
        keywords = {kw.arg for kw in node.keywords}
        if "group" not in keywords and None not in keywords:  # `**kwargs` may carry it
            found.append(f"{path.relative_to(root)}:{node.lineno} {name}(...) without group=")
    return found


def test_every_collective_call_in_library_code_names_its_group() -> None:
    sources = sorted(REPO.glob("packages/*/src/**/*.py"))
    assert len(sources) > 50  # the glob found the packages
    offenders = [line for path in sources for line in _calls_without_group(path)]
    assert offenders == []


def test_the_check_sees_a_call_without_a_group(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "comm.all_reduce(t)\n"
        "all_reduce(t, group=g)\n"
        "dist.barrier(**kw)\n"
        "broadcast(t, group_src=0)\n"
    )
    found = _calls_without_group(sample, tmp_path)
    assert [line.split(" ", 1)[0] for line in found] == ["sample.py:1", "sample.py:4"]
