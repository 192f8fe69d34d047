"""``ds-checkpoint export --dtype bf16`` of a tiny Llama loads with ``from_pretrained``.

Two gloo ranks save a tiny ``LlamaForCausalLM``'s weights with ``deepshard.checkpoint.save``,
each parameter cut in two flat halves (ZeRO stage-3 style ``module/<name>`` entries). The CLI
exports them in bf16 with a small ``--max-shard-size``, so the weights are split across files
with ``model.safetensors.index.json``. ``transformers`` loads the folder back and must give the
same logits as the source model loaded in bf16 by transformers from its own save_pretrained
(and nearly those of the source cast with ``.to(bf16)``); ``safetensors.torch.load_file`` of
the files must give the source weights in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.checkpoint import ShardedTensor, save
from deepshard.checkpoint.cli import main
from deepshard.interface import ShardMap
from deepshard.testing import run_on_mesh

transformers = pytest.importorskip("transformers")


def _config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def _model() -> Any:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    with torch.no_grad():  # untrained norms are all ones; make every tensor distinctive
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model.eval()


def _save_halves(mesh: Any, root: Path) -> None:
    rank = mesh.get_rank()
    state: dict[str, Any] = {}
    for name, tensor in _model().state_dict().items():
        numel = tensor.numel()
        half = -(-numel // 2)
        bounds = [(r, r * half, min(numel, (r + 1) * half)) for r in range(2)]
        smap = ShardMap.flat_partition(tuple(tensor.shape), "float32", bounds=bounds)
        local = tensor.reshape(-1)[rank * half : (rank + 1) * half].clone()
        state[f"module/{name}"] = ShardedTensor(local, smap, rank)
    save(state, root, tag="trained", group=mesh["dp"])


@pytest.mark.timeout(600)
def test_bf16_export_gives_the_source_logits(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_on_mesh(_save_halves, 2, args=(root,), store_dir=tmp_path, timeout_s=240)
    _config().save_pretrained(tmp_path / "cfg")
    out = tmp_path / "hf"
    argv = ["export", str(root), str(out), "--dtype", "bf16", "--max-shard-size", "20KB"]
    assert main([*argv, "--config", str(tmp_path / "cfg" / "config.json")]) == 0

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    source = _model()
    expected = {k: v.to(torch.bfloat16) for k, v in source.state_dict().items()}
    assert sorted(index["weight_map"]) == sorted(expected)
    from safetensors.torch import load_file

    loaded = {k: v for f in files for k, v in load_file(str(out / f)).items()}
    assert sorted(loaded) == sorted(expected)
    assert all(
        loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], expected[k]) for k in expected
    )
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in expected.values())

    exported = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    # The source model in bf16 as transformers itself loads it: saved by save_pretrained (fp32)
    # and read with from_pretrained(dtype=bf16). (A model cast with .to(bf16) also casts the
    # rotary inv_freq buffer, which from_pretrained keeps in fp32, so it differs in the last bit.)
    source.save_pretrained(tmp_path / "source")
    reference = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "source", dtype=torch.bfloat16
    ).eval()
    with torch.no_grad():
        want = reference(ids).logits
        got = exported(ids).logits
        cast = source.to(torch.bfloat16)(ids).logits
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    torch.testing.assert_close(got, cast, atol=2e-2, rtol=2e-2)
