"""AutoTP through ``initialize`` on architectures with their own quirks, at TP 2 on 2 gloo ranks.

* GLM-4: its Hugging Face plan gathers the fused ``gate_up_proj`` and re-splits ``down_proj``'s
  input (``rowwise_split_input``), which AutoTP does not apply; the ``glm4`` preset plans it
  instead (with a warning), the fused weight trained through ``Shard(0, parts)``.
* Bloom: the model builds one ALiBi bias for all heads; each rank's attention must narrow it to
  its own heads (their slopes), or the shapes do not even match.
* GPT-2: its projections are transformers' ``Conv1D``, which AutoTP does not split; rather than
  run with every rank computing the whole model without a word, ``initialize`` warns, naming
  Conv1D.

`STEPS` AdamW steps at ZeRO-1, clipped at 1.0, must give the one-process reference's losses
(dropout off, the same batch on both ranks).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface import Topology
from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # multi-rank: the main run covers it

STEPS, LR, EPS, CLIP, VOCAB = 3, 1e-2, 1e-3, 1.0, 128
"""``EPS``: Adam's, as in ``test_tp_llama_zero_matches_reference.py`` (an element whose gradient
nearly cancels would turn summation-order rounding into an update of up to ``lr`` at 1e-8)."""
KINDS = ("glm4", "bloom")


def _model(kind: str) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    if kind == "glm4":
        sizes = {"intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16}
        config: Any = T.Glm4Config(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            pad_token_id=0, **sizes,
        )  # fmt: skip
        return T.Glm4ForCausalLM(config)
    if kind == "bloom":
        return T.BloomForCausalLM(
            T.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4,
                          hidden_dropout=0.0, attention_dropout=0.0)
        )  # fmt: skip
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4))


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(step))


def _config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
    }


def _train(mesh: Any) -> dict[str, Any]:
    import deepshard.engine as ds
    from deepshard.autotp import AutoTPWarning

    out: dict[str, Any] = {}
    for kind in KINDS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AutoTPWarning)
            engine, _, _, _ = ds.initialize(_model(kind), _config(), mesh=mesh)
        losses = []
        for step in range(STEPS):
            ids = _batch(step)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[kind] = {"losses": losses, "warnings": [str(w.message) for w in caught]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AutoTPWarning)
        ds.initialize(_model("gpt2"), _config(), mesh=mesh)
    out["gpt2"] = [str(w.message) for w in caught if issubclass(w.category, AutoTPWarning)]
    return out


def _reference(kind: str) -> list[float]:
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        ids = _batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_glm4_and_bloom_train_like_one_process_and_gpt2_is_flagged(tmp_path: Path) -> None:
    ranks = run_on_mesh(_train, 2, topology=Topology(tp=2), store_dir=tmp_path, timeout_s=300)
    for kind in KINDS:
        want = _reference(kind)
        for rank in ranks:
            assert rank[kind]["losses"] == pytest.approx(want, rel=1e-5), kind
    for rank in ranks:
        assert any("'glm4' preset instead" in w for w in rank["glm4"]["warnings"])
        (gpt2,) = [w for w in rank["gpt2"] if "found nothing to split" in w]
        assert gpt2.startswith("AutoTP found nothing to split in GPT2LMHeadModel")
        assert "Conv1D (transformer.h.0.attn.c_attn" in gpt2
