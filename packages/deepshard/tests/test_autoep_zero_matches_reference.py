"""``initialize`` with ``expert_parallel.enabled``: tiny HF MoE models replaced by
AutoEP (EP = 2 on 2 gloo ranks) and trained under ZeRO-2 and ZeRO-3, against one process.

``initialize`` parallelizes the experts before the cast (each rank keeps half of them) and
hands AutoEP's placements to ZeRO: expert weights partitioned and reduced over ``dp`` (one rank
here), dense ones over ``dp × ep``. Each rank reads its own micro-batch (the batch group is
``dp × ep``). Mixtral (4 experts) runs at ZeRO-2 and ZeRO-3; DeepSeek-V3 (8 experts, sigmoid
group-limited routing, a shared expert, a non-zero ``e_score_correction_bias``) at ZeRO-3. The
reference is the unreplaced model in one process stepping on the mean of the two ranks'
losses, clipped at 1.0 (active on every step), then AdamW. Five steps must give each rank its
batch's reference loss, and every parameter (experts gathered over ``ep``) the reference's
value; DeepSeek's bias must still be a persistent buffer with the same values (it is not
trained). One run also builds the optimizer itself, before ``initialize``, with the experts in
their own param group (no weight decay): ``initialize`` must move it onto the new expert
tensors, or the experts would not train. Bad AutoEP settings are refused on a fake
process group, naming the key.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import deepshard.engine as ds
from deepshard.interface import PlacementRegistry, Topology
from deepshard.interface.errors import ConfigError
from deepshard.testing import fake_mesh, run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

pytest.importorskip("transformers", reason="transformers is in the dev group only")

STEPS, LR, CLIP, WD, MB, SEQ, VOCAB, EXPERTS = 5, 1e-2, 1.0, 0.01, 2, 8, 96, 4
EPS = 1e-3
"""Adam's ``eps``: with torch's 1e-8 a gradient element that nearly cancels (summed in another
order by the grouped experts than by the HF loop) turns its rounding into an update of up to
``lr``; with 1e-3 a rounding error ``δ`` moves an update by at most ``lr · δ / eps``."""
ATOL = 1e-5
RUNS = (
    ("mixtral", 2, False),
    ("mixtral", 3, False),
    ("mixtral", 2, True),
    ("deepseek_v3", 3, False),
)
"""(model, ZeRO stage, optimizer built by the caller with the experts in their own group)."""
NUM_EXPERTS = {"mixtral": EXPERTS, "deepseek_v3": 8}


_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    num_experts_per_tok=2,
    attn_implementation="eager",
)


def _deepseek(experts: int) -> torch.nn.Module:
    """DeepSeek-V3: sigmoid scores, group-limited routing, a shared expert, layer 0 dense."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        **_COMMON,
        num_key_value_heads=4,
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=experts,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    return DeepseekV3ForCausalLM(config)


def _model(experts: int = EXPERTS, family: str = "mixtral") -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    if family == "deepseek_v3":
        model = _deepseek(experts)
    else:
        config = MixtralConfig(
            **_COMMON,
            num_key_value_heads=2,
            intermediate_size=32,
            num_local_experts=experts,
            output_router_logits=True,
            router_aux_loss_coef=0.05,
        )
        model = MixtralForCausalLM(config)
    # HF's 0.02 init routes nearly uniformly, which would hide a wrong expert choice; a
    # non-zero correction bias changes DeepSeek's choice.
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.3)
    return model.float()


def _biases(model: torch.nn.Module) -> dict[str, list[float]]:
    """Every correction bias that is a persistent buffer, by name."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name == "e_score_correction_bias" and name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}"] = buffer.tolist()
    return out


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (MB, SEQ), generator=g)


def _config(stage: int, *, with_optimizer: bool = True, ep: int = 2) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "expert_parallel": {"enabled": True, "autoep_size": ep},
    }
    if with_optimizer:
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": WD, "eps": EPS},
        }
    return config


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    return [{"params": dense}, {"params": experts, "weight_decay": 0.0}]


def _train(mesh: Any, family: str, stage: int, own_optimizer: bool) -> dict[str, Any]:
    model = _model(NUM_EXPERTS[family], family)
    optimizer = None
    if own_optimizer:
        optimizer = torch.optim.AdamW(_groups(model), lr=LR, weight_decay=WD, eps=EPS)
    engine, zero, _, _ = ds.initialize(
        model, _config(stage, with_optimizer=not own_optimizer), optimizer=optimizer, mesh=mesh
    )
    dims = engine.parallel_dims
    losses = []
    for step in range(STEPS):
        ids = _batch(step, dims.batch_rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
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
    shapes = {n: tuple(v.shape) for n, v in local.items() if ".experts." in n}
    return {
        "losses": losses,
        "params": params,
        "shapes": shapes,
        "rank": dims.batch_rank,
        "biases": _biases(engine.module),
    }


def _all(mesh: Any) -> list[dict[str, Any]]:
    return [_train(mesh, family, stage, own) for family, stage, own in RUNS]


def _reference(family: str, own_optimizer: bool) -> dict[str, Any]:
    model = _model(NUM_EXPERTS[family], family)
    groups = _groups(model) if own_optimizer else model.parameters()
    inner = torch.optim.AdamW(groups, lr=LR, weight_decay=WD, eps=EPS)
    losses = []
    for step in range(STEPS):
        per_rank = [model(input_ids=_batch(step, r), labels=_batch(step, r)).loss for r in (0, 1)]
        torch.stack(per_rank).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP  # clipping acts
        inner.step()
        inner.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    return {"losses": losses, "params": dict(model.named_parameters()), "biases": _biases(model)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    store = tmp_path_factory.mktemp("autoep_zero")
    return run_on_mesh(_all, 2, topology=Topology(ep=2), store_dir=store, timeout_s=400)


@pytest.mark.timeout(450)
@pytest.mark.parametrize(
    "run", range(len(RUNS)), ids=[f"{f}-zero{s}{'-own-optimizer' if o else ''}" for f, s, o in RUNS]
)
def test_ep2_moe_matches_one_process(results: list[list[dict[str, Any]]], run: int) -> None:
    family, _, own = RUNS[run]
    ref = _reference(family, own)
    if family == "deepseek_v3":  # the bias is still a persistent buffer, with its values
        assert ref["biases"] and any(v != 0.0 for vs in ref["biases"].values() for v in vs)
    for rank_runs in results:
        got = rank_runs[run]
        assert got["shapes"], "no expert parameter was found"
        for name, shape in got["shapes"].items():
            assert shape[0] == NUM_EXPERTS[family] // 2, name  # only this rank's experts
        assert got["biases"] == ref["biases"]
        want_losses = [step[got["rank"]] for step in ref["losses"]]
        assert got["losses"] == pytest.approx(want_losses, rel=1e-5)
        assert set(got["params"]) == set(ref["params"])
        for name, value in got["params"].items():
            torch.testing.assert_close(
                value,
                ref["params"][name].detach(),
                rtol=1e-5,
                atol=ATOL,
                msg=lambda m, n=name: f"{n}: {m}",
            )


def _initialize(config: dict[str, Any], topology: Topology, **kwargs: Any) -> None:
    with fake_mesh(topology, 1) as mesh:
        ds.initialize(_model(kwargs.pop("experts", EXPERTS)), config, mesh=mesh, **kwargs)


def test_autoep_size_must_divide_the_experts() -> None:
    with pytest.raises(ConfigError, match=r"expert_parallel\.autoep_size: 2 does not divide the 3"):
        _initialize(_config(2), Topology(ep=2), experts=3)


def test_autoep_size_must_be_the_mesh_ep() -> None:
    with pytest.raises(ConfigError, match=r"expert_parallel\.autoep_size: 2 differs from the mesh"):
        _initialize(_config(2), Topology(dp=2))


def test_placements_and_an_expert_tp_size_other_than_tp_are_refused_with_autoep() -> None:
    registry = PlacementRegistry.replicated(_model().named_parameters(), Topology(ep=2))
    with pytest.raises(ConfigError, match=r"initialize\(placements=\) together with expert"):
        _initialize(_config(2), Topology(ep=2), placements=registry)
    with_tp = {**_config(3), "tensor_parallel": {"autotp_size": 2}}
    with_tp["expert_parallel"] = {**with_tp["expert_parallel"], "expert_tensor_parallel_size": 4}
    with pytest.raises(ConfigError, match=r"expert_tensor_parallel_size: 4 differs from the mesh"):
        _initialize(with_tp, Topology(ep=2, tp=2))
