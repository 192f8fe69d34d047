"""AutoEP and AutoTP on one mesh: ``expert_parallel: {autoep_size: 2}`` with ``tensor_parallel:
{autotp_size: 2}`` through ``initialize`` on 4 gloo ranks (dp 1 × ep 2 × tp 2) trains a tiny
Qwen3-MoE like one process.

The model (hidden 64, 4 query / 2 KV heads, 2 layers, fp32) has a dense MLP in layer 0
(``mlp_only_layers``) and 4 top-2 experts in layer 1. AutoEP replaces the MoE block first (each
``ep`` rank keeps 2 experts), then AutoTP splits attention, the dense MLP and the LM head over
``tp`` and leaves the expert stacks and the router whole: both ``tp`` ranks of an ``ep`` group
hold the same experts. Qwen3's ``q_norm``/``k_norm`` are replicated with their gradients summed
over ``tp``. TP peers read the same micro-batch, the two ``ep`` groups different ones.

ZeRO stages 1, 2 and 3, AdamW, clipping at 1.0 (active every step), `STEPS` steps against the
unreplaced model in one process stepping on the mean of the two batches' losses: every rank's
losses must be its batch's reference losses to 1e-5 relative, every TP-split parameter its
slice of the reference (AutoTP's shard maps), every expert stack (gathered over ``ep``) and
every other parameter the reference's value, to 1e-5. A wrong gradient group (experts averaged
over ``tp``, or summed there, or the norm counting the tp-replicated experts twice) moves the
weights by far more. Local shapes are asserted: experts split by ``ep`` only, ``q_proj`` by
``tp`` only.

With ``expert_tensor_parallel_size: 2`` (ZeRO 1 and 3) each local expert is split over ``tp``
too: ``gate_up`` keeps its ``tp`` rank's half of the gate rows and of the up rows, ``down`` the
matching columns, and the expert outputs are summed over ``tp`` before the combine. The same
losses are required, and every expert stack (gathered over ``ep``) must be the reference's
slice, cut here from the reference by those rows and columns. A size that is not the mesh's
``tp`` (4) is refused, naming the key. The expert-TP ZeRO-3 run saves a checkpoint, which loads
at (ep 2, tp 1, experts whole, ZeRO-3) and at (ep 1, tp 2, expert TP, ZeRO-2): logits on a fixed
batch must be the reference model's after `STEPS` steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.interface import Topology
from deepshard.testing import run_on_mesh

# multi-rank and over ~10 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

pytest.importorskip("transformers", reason="transformers is in the dev group only")

STEPS, LR, CLIP, MB, SEQ, VOCAB, EXPERTS, HIDDEN, HEAD_DIM = 3, 1e-2, 1.0, 2, 8, 96, 4, 64, 16
RUNS = ((1, 1), (2, 1), (3, 1), (1, 2), (3, 2))
"""(ZeRO stage, expert_tensor_parallel_size)."""
MOE_INTER = 32
EPS = 1e-3
"""Adam's ``eps``, as in ``test_autoep_zero_matches_reference.py``: a gradient element that
nearly cancels (summed in another order by the grouped experts and the TP layers) would turn
its rounding into an update of up to ``lr`` with torch's 1e-8."""


def _model() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        intermediate_size=64,
        moe_intermediate_size=MOE_INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        max_position_embeddings=64,
        output_router_logits=True,
        router_aux_loss_coef=0.05,
        attn_implementation="eager",
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    # HF's 0.02 init routes nearly uniformly, which would hide a wrong expert choice.
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    return model.float()


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (MB, SEQ), generator=g)


def _config(stage: int, expert_tp: int = 1, ep: int = 2, tp: int = 2) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "torch_adam": True}},
        "expert_parallel": {
            "enabled": True,
            "autoep_size": ep,
            "expert_tensor_parallel_size": expert_tp,
        },
        "tensor_parallel": {"autotp_size": tp},
    }


def _probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (MB, SEQ), generator=torch.Generator().manual_seed(99))


def _run(dims: Any, stage: int, expert_tp: int, root: str | None = None) -> dict[str, Any]:
    import deepshard.engine as ds
    from deepshard.autotp import tp_state

    engine, zero, _, _ = ds.initialize(_model(), _config(stage, expert_tp), mesh=dims)
    losses = []
    for step in range(STEPS):
        ids = _batch(step, dims.batch_rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if root is not None:
        engine.save_checkpoint(root)
    gathered = zero.sharded.gathered() if stage == 3 else torch.no_grad()
    with gathered:
        local = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    params = {}
    for name, value in local.items():
        if ".experts." in name:  # this rank's experts: gather the others over ep
            parts = [torch.empty_like(value) for _ in range(dims.topology.ep)]
            torch.distributed.all_gather(parts, value.contiguous(), group=dims.ep.get_group())
            value = torch.cat(parts)
        params[name] = value
    return {
        "losses": losses,
        "params": params,
        "shapes": {n: tuple(v.shape) for n, v in local.items()},
        "maps": tp_state(engine.module).shard_maps,
    }


def _train(mesh: Any, root: str) -> dict[str, Any]:
    import deepshard.engine as ds
    from deepshard.comm import ParallelDims
    from deepshard.interface.errors import ConfigError

    dims = ParallelDims.from_mesh(mesh)
    runs = {run: _run(dims, *run, root=root if run == (3, 2) else None) for run in RUNS}
    try:
        ds.initialize(_model(), _config(1, expert_tp=4), mesh=dims)
        refusal = "accepted"
    except ConfigError as exc:
        refusal = str(exc)
    return {"runs": runs, "refusal": refusal, "batch_rank": dims.batch_rank, **dims.coordinate}


def _load(mesh: Any, root: str, stage: int, expert_tp: int) -> torch.Tensor:
    import deepshard.engine as ds

    topology = mesh_topology(mesh)
    config = _config(stage, expert_tp, ep=topology.ep, tp=topology.tp)
    engine, _, _, _ = ds.initialize(_model(), config, mesh=mesh)
    engine.load_checkpoint(root)
    with torch.no_grad():
        return engine(input_ids=_probe()).logits.detach().clone()


def mesh_topology(mesh: Any) -> Topology:
    from deepshard.comm import ParallelDims

    return ParallelDims.from_mesh(mesh).topology


def _reference() -> dict[str, Any]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        per_rank = [model(input_ids=_batch(step, r), labels=_batch(step, r)).loss for r in (0, 1)]
        torch.stack(per_rank).mean().backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP  # clipping acts
        opt.step()
        opt.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    with torch.no_grad():
        probe = model(input_ids=_probe()).logits
    return {"losses": losses, "params": dict(model.named_parameters()), "probe": probe}


def _expert_slice(name: str, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """The ``tp`` rank's slice of a whole expert stack under expert TP (Megatron's split)."""
    w = MOE_INTER // 2
    cut = slice(tp_rank * w, (tp_rank + 1) * w)
    if name.endswith("gate_up_proj"):
        return torch.cat([full[:, :MOE_INTER][:, cut], full[:, MOE_INTER:][:, cut]], dim=1)
    return full[..., cut]


def _check_params(
    got: dict[str, Any], ref: dict[str, Any], tp_rank: int, what: str, expert_tp: int
) -> int:
    split = 0
    assert set(got["params"]) == set(ref["params"]), what
    for name, value in got["params"].items():
        full = ref["params"][name].detach()
        smap = got["maps"].get(name)
        if ".experts." in name and expert_tp > 1:
            split += 1
            full = _expert_slice(name, full, tp_rank)
        elif smap is not None:
            split += 1
            full = torch.tensor(smap.extract(full.reshape(-1).tolist(), tp_rank))
        torch.testing.assert_close(
            value.reshape(-1), full.reshape(-1), rtol=1e-5, atol=1e-5, msg=f"{what} {name}"
        )
    return split


def _check_shapes(shapes: dict[str, tuple[int, ...]], what: str, expert_tp: int) -> None:
    experts, inter = "model.layers.1.mlp.experts", MOE_INTER // expert_tp
    assert shapes[f"{experts}.gate_up_proj"] == (EXPERTS // 2, 2 * inter, HIDDEN), what
    assert shapes[f"{experts}.down_proj"] == (EXPERTS // 2, HIDDEN, inter), what
    assert shapes["model.layers.1.mlp.gate.weight"] == (EXPERTS, HIDDEN), what  # router whole
    for layer in (0, 1):
        q = shapes[f"model.layers.{layer}.self_attn.q_proj.weight"]
        assert q == (4 * HEAD_DIM // 2, HIDDEN), what
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (HIDDEN, 64 // 2), what


@pytest.mark.timeout(600)
def test_ep2_tp2_qwen3_moe_matches_one_process(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    results = run_on_mesh(
        _train, 4, topology=Topology(ep=2, tp=2), args=(root,), store_dir=tmp_path, timeout_s=500
    )
    ref = _reference()
    initial = dict(_model().named_parameters())
    assert max(float((ref["params"][n] - p).detach().norm()) for n, p in initial.items()) > 1e-3
    assert [(r["ep"], r["tp"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank in results:
        assert rank["batch_rank"] == rank["ep"]  # TP peers read the same batch
        for stage, expert_tp in RUNS:
            got = rank["runs"][stage, expert_tp]
            what = f"ep {rank['ep']} tp {rank['tp']} zero-{stage} expert-tp {expert_tp}"
            _check_shapes(got["shapes"], what, expert_tp)
            want = [step[rank["batch_rank"]] for step in ref["losses"]]
            assert got["losses"] == pytest.approx(want, rel=1e-5), what
            # q k v o of two layers, the dense MLP's three, the LM head and the embedding
            # (and the two expert stacks under expert TP)
            split = 8 + 3 + 2 + (2 if expert_tp > 1 else 0)
            assert _check_params(got, ref, rank["tp"], what, expert_tp) >= split, what
        assert rank["refusal"].startswith("expert_parallel.expert_tensor_parallel_size: 4")
        assert "mesh's tp axis of size 2" in rank["refusal"]
    for topology, stage, expert_tp in ((Topology(ep=2), 3, 1), (Topology(tp=2), 2, 2)):
        store = tmp_path / f"load_ep{topology.ep}_tp{topology.tp}"
        loaded = run_on_mesh(
            _load, 2, topology=topology, args=(root, stage, expert_tp), store_dir=store
        )
        for logits in loaded:
            torch.testing.assert_close(logits, ref["probe"], rtol=1e-4, atol=1e-5)
