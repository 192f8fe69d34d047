"""The README's example runs as written in a fresh interpreter and prints what HF generate gives."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

README = Path(__file__).parents[1] / "README.md"


def _hf_new_tokens(prompt: list[int], new: int) -> list[int]:
    """The same seeded model through Hugging Face ``generate``, one unpadded prompt at a time."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_the_readme_example_prints_hf_tokens(tmp_path: Path) -> None:
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert match, "the README has no python example"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    expected = [_hf_new_tokens([5, 9, 11], 6), _hf_new_tokens([3, 1, 4, 1], 6)]
    assert done.stdout.splitlines()[-1] == f"(2, 10) {expected}"
