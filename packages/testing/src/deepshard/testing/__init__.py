"""Test-only helpers for DeepShard: run a function on N gloo ranks, fake meshes.

``run_on_mesh`` starts real ranks in subprocesses (gloo on CPU); ``fake_mesh`` plays one rank of
a larger world in the current process for rank arithmetic; ``import_beside`` loads a helper
module next to a test file; ``run_readme_example`` runs a package README's example;
``greedy_new_tokens`` is the Hugging Face ``generate`` reference of one prompt. Importing this
package does not import torch.
"""

from __future__ import annotations

from deepshard.testing._beside import import_beside
from deepshard.testing._errors import MeshTimeoutError, RankFailedError
from deepshard.testing._fake_mesh import fake_mesh
from deepshard.testing._generate import greedy_new_tokens
from deepshard.testing._readme import ReadmeExampleError, readme_example_code, run_readme_example
from deepshard.testing._run_on_mesh import run_on_mesh

__all__ = [
    "MeshTimeoutError",
    "RankFailedError",
    "ReadmeExampleError",
    "fake_mesh",
    "greedy_new_tokens",
    "import_beside",
    "readme_example_code",
    "run_on_mesh",
    "run_readme_example",
]
