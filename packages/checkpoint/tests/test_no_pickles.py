"""No code under packages/ unpickles: no `import pickle`, no `pickle.load`, and every
`torch.load(` call passes `weights_only=True`."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]
# Test-only code that pickles its own objects, never a checkpoint: deepshard.testing passes the
# rank function's arguments and results between the processes it starts (production code may
# not import it: the import-linter "test-only" contract), and two tests check that errors and
# the rank payload survive the pickling multiprocessing does.
ALLOWED = {
    "testing/src/deepshard/testing/_rank_main.py",
    "testing/src/deepshard/testing/_run_on_mesh.py",
    "testing/tests/test_run_on_mesh_rendezvous_retry.py",
    "interface/tests/test_config_error_messages.py",
}
_THIS = Path(__file__).resolve()

_PICKLE = re.compile(
    r"^\s*(import pickle|from pickle import|import cPickle)|pickle\.loads?\(", re.M
)
_TORCH_LOAD = re.compile(r"torch\.load\(")


def _torch_load_calls(text: str) -> list[str]:
    calls = []
    for match in _TORCH_LOAD.finditer(text):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        calls.append(text[match.start() : end + 1])
    return calls


def test_scanner_catches_what_it_should() -> None:
    assert _PICKLE.search("import pickle\n") and _PICKLE.search("x = pickle.load(f)")
    bad, good = (
        _torch_load_calls("torch.load(f, map_location=dev(1))"),
        "torch.load(f, weights_only=True)",
    )
    assert bad and "weights_only=True" not in bad[0]
    assert "weights_only=True" in _torch_load_calls(good)[0]


def test_no_module_unpickles() -> None:
    offenders = []
    files = sorted(PACKAGES.glob("*/**/*.py"))
    assert len(files) > 50  # the scan sees the whole tree
    for path in files:
        rel = str(path.relative_to(PACKAGES))
        if path.resolve() == _THIS or rel in ALLOWED or "/.venv/" in str(path):
            continue
        text = path.read_text(encoding="utf-8")
        if _PICKLE.search(text):
            offenders.append(f"{rel}: pickle")
        offenders += [
            f"{rel}: {c}" for c in _torch_load_calls(text) if "weights_only=True" not in c
        ]
    assert not offenders, offenders
