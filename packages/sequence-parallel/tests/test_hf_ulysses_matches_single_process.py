"""`apply_ulysses` + `shard_batch` on a tiny Llama equal one process on the whole sequence.

Two gloo ranks form the ``sp`` group; one `run_on_mesh` call runs every case. Each rank feeds
its half of every sequence (16 tokens, 8 per rank) to a two-layer Llama with grouped-query
attention (4 query heads, 2 KV heads; also 1 KV head, replicated over the two ranks, with the
query/KV ratio the core attention reads adjusted per call), computes the SP loss and backward,
and averages its gradients over ``sp`` as ZeRO does over ``dp × ep × sp``. The parent runs
the same model on the whole sequence in one process. Labels are masked so that the two shards
hold very different numbers of valid tokens (row 0: none in shard 0), which a mean of
per-shard means would get wrong. Packed rows (positions restarting mid-sequence) are checked
against transformers' own packed-sequence masks. flex_attention has no backward on CPU, so it
is checked forward only.

In the same run: two models in one process keep their own settings (a Ulysses eager model, a
Ulysses sdpa model and a plain model, called interleaved); ``disable_in_eval`` runs the plain
attention and loss on a whole batch in eval mode; and bad uses are refused with a ConfigError.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from deepshard.interface import Topology
from deepshard.testing import run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

SEQ = 16
VOCAB = 64
# (attention, packed rows, KV heads); 1 KV head on 2 ranks is replicated by DistributedAttention
TRAINED = [
    ("sdpa", False, 2),
    ("eager", False, 2),
    ("sdpa", True, 2),
    ("eager", True, 2),
    ("sdpa", True, 1),
    ("eager", False, 1),
]


def _llama(attn: str, seed: int = 0, kv_heads: int = 2) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=2 * SEQ,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def _batch(packed: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :11] = -100  # shard 0 of row 0 has no valid label, shard 1 five
    labels[1, 13:] = -100
    # use_cache=False: with a cache, transformers skips its packed-sequence masks
    batch: dict[str, Any] = {"input_ids": ids, "labels": labels, "use_cache": False}
    if packed:  # row 1 packs two documents: 0..9 then 0..5
        positions = torch.arange(SEQ).repeat(2, 1)
        positions[1, 10:] = torch.arange(SEQ - 10)
        batch["position_ids"] = positions
    return batch


def _sp_step(model: Any, shard: dict[str, Any], dense_dp: Any) -> dict[str, Any]:
    from deepshard.comm import all_reduce

    loss = model(**shard).loss
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        all_reduce(grad, group=dense_dp, op="avg")
        grads[name] = grad
    return {"loss": loss.detach(), "grads": grads}


def _refusal(call: Any) -> str:
    from deepshard.interface.errors import ConfigError

    try:
        call()
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def _all_cases(mesh: Any) -> dict[str, Any]:
    from deepshard.comm import ParallelDims
    from deepshard.sequence_parallel import apply_ulysses, shard_batch

    dims = ParallelDims.from_mesh(mesh)

    def shard(batch: dict[str, Any]) -> dict[str, Any]:
        return shard_batch(batch, sp_rank=dims.sp.get_local_rank(), sp_size=dims.sp.size())

    out: dict[str, Any] = {}
    for attn, packed, kv in TRAINED:
        model = apply_ulysses(_llama(attn, kv_heads=kv), dims)
        out[f"{attn}-{packed}-{kv}"] = _sp_step(model, shard(_batch(packed)), dims.dense_dp)
    for packed in (False, True):  # forward only: flex_attention has no CPU backward
        with torch.no_grad():
            flex = apply_ulysses(_llama("flex_attention"), dims)
            out[f"flex-{packed}"] = flex(**shard(_batch(packed))).logits
    # two Ulysses models and a plain one in one process, called interleaved
    eager, sdpa, plain = (_llama(a, seed=s) for a, s in (("eager", 1), ("sdpa", 2), ("sdpa", 3)))
    apply_ulysses(eager, dims)
    apply_ulysses(sdpa, dims)
    whole = _batch(True)
    out["two"] = [
        eager(**shard(whole)).loss.detach(),
        plain(**whole).loss.detach(),
        sdpa(**shard(whole)).loss.detach(),
    ]
    evaluated = apply_ulysses(_llama("sdpa"), dims, disable_in_eval=True).eval()
    with torch.no_grad():
        out["eval"] = evaluated(**whole).loss
    trained = apply_ulysses(_llama("sdpa"), dims)
    no_positions = {k: v for k, v in shard(whole).items() if k != "position_ids"}
    out["refused"] = {
        "linear": _refusal(lambda: apply_ulysses(torch.nn.Linear(2, 2), dims)),
        "twice": _refusal(lambda: apply_ulysses(trained, dims)),
        "no positions": _refusal(lambda: trained(**no_positions)),
        "no shift_labels": _refusal(
            lambda: trained(**{k: v for k, v in shard(whole).items() if k != "shift_labels"})
        ),
    }
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    store = tmp_path_factory.mktemp("ulysses_hf")
    return run_on_mesh(_all_cases, 2, topology=Topology(sp=2), store_dir=store, timeout_s=240)


def _reference(attn: str, packed: bool, kv: int) -> dict[str, Any]:
    model = _llama(attn, kv_heads=kv)
    loss = model(**_batch(packed)).loss
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize(("attn", "packed", "kv"), TRAINED)
def test_two_sp_ranks_match_the_whole_sequence(
    ranks: list[dict[str, Any]], attn: str, packed: bool, kv: int
) -> None:
    ref = _reference(attn, packed, kv)
    for result in (r[f"{attn}-{packed}-{kv}"] for r in ranks):
        torch.testing.assert_close(result["loss"], ref["loss"], rtol=1e-6, atol=0.0)
        for name, expected in ref["grads"].items():
            torch.testing.assert_close(
                result["grads"][name], expected, rtol=1e-5, atol=1e-7, msg=name
            )


@pytest.mark.parametrize("packed", [False, True])
def test_flex_attention_forward_matches_the_whole_sequence(
    ranks: list[dict[str, Any]], packed: bool
) -> None:
    with torch.no_grad():
        expected = _llama("flex_attention")(**_batch(packed)).logits
    shards = torch.cat([r[f"flex-{packed}"] for r in ranks], dim=1)
    torch.testing.assert_close(shards, expected, rtol=1e-5, atol=1e-6)


def test_two_models_in_one_process_keep_their_own_attention(ranks: list[dict[str, Any]]) -> None:
    whole = _batch(True)
    expected = [
        _llama(a, seed=s)(**whole).loss.detach()
        for a, s in (("eager", 1), ("sdpa", 3), ("sdpa", 2))
    ]
    for result in ranks:
        torch.testing.assert_close(
            torch.stack(result["two"]), torch.stack(expected), rtol=1e-6, atol=0
        )


def test_disable_in_eval_runs_the_plain_model_on_whole_batches(
    ranks: list[dict[str, Any]],
) -> None:
    expected = _llama("sdpa").eval()(**_batch(True)).loss.detach()
    for result in ranks:
        torch.testing.assert_close(result["eval"], expected, rtol=1e-6, atol=0.0)


def test_bad_uses_are_refused_with_the_fix(ranks: list[dict[str, Any]]) -> None:
    refused = ranks[0]["refused"]
    assert "Hugging Face transformers model" in refused["linear"]
    assert "DistributedAttention" in refused["linear"]
    assert "applied to this LlamaForCausalLM already" in refused["twice"]
    assert "position_ids" in refused["no positions"]
    assert "UlyssesDataLoaderAdapter" in refused["no positions"]
    assert "shift_labels" in refused["no shift_labels"]
