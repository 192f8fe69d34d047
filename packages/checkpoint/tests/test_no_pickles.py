"""No code under packages/ unpickles: no `pickle.load`/`loads`/`Unpickler`, and every
`torch.load(` call passes `weights_only=True` (importing `pickle` for its exception type, as
the DeepSpeed reader does to catch `UnpicklingError`, unpickles nothing)."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2]
# Test-only code that pickles its own objects, never a checkpoint: deepshard.testing passes the
# rank function's arguments and results between the processes it starts (production code may
# not import it: the import-linter "test-only" contract), and two tests check that errors and
# the rank payload survive the pickling multiprocessing does. The malicious-pickle test loads
# its own payload once unrestricted, to show the payload is live (so the refusal means
# something).
ALLOWED = {
    "checkpoint/tests/test_import_deepspeed_refuses_pickles.py",
    "testing/src/deepshard/testing/_rank_main.py",
    "testing/src/deepshard/testing/_run_on_mesh.py",
    "testing/tests/test_run_on_mesh_rendezvous_retry.py",
    "interface/tests/test_config_error_messages.py",
}
_THIS = Path(__file__).resolve()

_PICKLE = re.compile(
    r"\bpickle\.(loads?|Unpickler)\b|^\s*from pickle import .*\b(loads?|Unpickler)\b"
    r"|^\s*import cPickle",
    re.M,
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
    assert _PICKLE.search("x = pickle.load(f)") and _PICKLE.search("from pickle import loads\n")
    assert _PICKLE.search("pickle.Unpickler(f).load()")
    assert not _PICKLE.search("except pickle.UnpicklingError:")
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
