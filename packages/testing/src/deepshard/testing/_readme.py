"""Running a package README's example the way a reader would.

Every package README carries one runnable example (the first ```python block), and a test runs
it. Before this helper each package copied the same twenty lines: find the block, write it to a
file, strip the launcher variables of any enclosing run (an example that calls
``init_process_group`` would otherwise join that world), start a fresh interpreter with one
OpenMP thread, and fail with the example's stderr. `run_readme_example` is those lines, once;
what a test then checks in the example's output stays in the test.

A fresh interpreter is the honest default: the example runs with exactly the imports it writes.
``in_process=True`` runs it in the test's own interpreter instead, for examples whose packages
are already imported (torch costs seconds to import in a new process on a busy machine); the
launcher variables are removed for the duration, and a default process group the example left
behind is destroyed.

Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["ReadmeExampleError", "readme_example_code", "run_readme_example"]

_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
# Variables through which a launcher (torchrun, ds-launch, SLURM, Open MPI) hands a process its
# place in a world. The example must start a world of its own.
_LAUNCH_VARS = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
)
_LAUNCH_PREFIXES = ("OMPI_", "PMI_", "SLURM_", "TORCHELASTIC_")


class ReadmeExampleError(AssertionError):
    """A README has no python example, or its example failed.

    Attributes:
        readme: The README the example came from.
        stderr: What the example wrote to stderr (the traceback), or ``""``.
    """

    def __init__(self, readme: Path, message: str, *, stderr: str = "") -> None:
        self.readme = readme
        self.stderr = stderr
        super().__init__(f"{readme}: {message}" + (f"\n{stderr.rstrip()}" if stderr else ""))


def readme_example_code(readme: str | Path) -> str:
    """The first ```python block of ``readme``.

    Raises:
        ReadmeExampleError: The README has no such block.
    """
    path = Path(readme)
    match = _BLOCK.search(path.read_text(encoding="utf-8"))
    if match is None:
        raise ReadmeExampleError(path, "has no ```python block; add the package's example")
    return match.group(1)


def _example_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in _LAUNCH_VARS and not name.startswith(_LAUNCH_PREFIXES)
    }
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def run_readme_example(
    readme: str | Path,
    *,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    in_process: bool = False,
) -> str:
    """Runs the first ```python block of ``readme`` and returns what it printed.

    Args:
        readme: The package's ``README.md``.
        timeout_s: How long the fresh interpreter may run (ignored with ``in_process``).
        env: Variables set for the example on top of the test's environment, from which the
            launcher variables are removed and where ``OMP_NUM_THREADS`` is 1.
        cwd: The example's working directory; by default a temporary folder, removed after.
        in_process: Run the example in this interpreter (see the module docstring).

    Returns:
        The example's stdout.

    Raises:
        ReadmeExampleError: The README has no example, or the example exited non-zero, raised,
            or ran past ``timeout_s``.
    """
    path = Path(readme).resolve()
    code = readme_example_code(path)
    if in_process:
        return _run_here(path, code, env)
    with contextlib.ExitStack() as stack:
        folder = Path(cwd) if cwd is not None else Path(stack.enter_context(_temporary_dir()))
        script = folder / "readme_example.py"
        script.write_text(code, encoding="utf-8")
        try:
            done = subprocess.run(
                [sys.executable, str(script)],
                cwd=folder,
                env=_example_env(env),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as error:
            stderr = error.stderr.decode() if isinstance(error.stderr, bytes) else ""
            raise ReadmeExampleError(
                path, f"the example ran past {timeout_s:g} s; raise timeout_s", stderr=stderr
            ) from None
    if done.returncode != 0:
        raise ReadmeExampleError(
            path, f"the example exited with code {done.returncode}", stderr=done.stderr
        )
    return done.stdout


@contextlib.contextmanager
def _temporary_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="deepshard-readme-") as folder:
        yield folder


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _destroy_leftover_group() -> None:
    # Only when the example imported torch.distributed: this module never imports torch itself.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _run_here(path: Path, code: str, env: Mapping[str, str] | None) -> str:
    out = io.StringIO()
    with _environment(_example_env(env)), contextlib.redirect_stdout(out):
        try:
            exec(compile(code, str(path), "exec"), {"__name__": "readme_example"})
        except Exception as error:
            raise ReadmeExampleError(path, f"the example raised {error!r}") from error
        finally:
            _destroy_leftover_group()
    return out.getvalue()
