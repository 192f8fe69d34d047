"""Built-in layer specs per model family: what ``tensor_parallel.preset_model`` selects.

A preset is the same data a user writes in ``partition_config.layer_specs``, so presets and
user specs go through one matcher. The families are DeepSpeed's (llama, qwen2, mixtral,
deepseek_v2, phi3, bloom, chatglm) plus qwen3, whose per-head ``q_norm``/``k_norm`` are kept
whole with their gradients all-reduced, and transformers' glm/glm4 (a fused ``gate_up_proj``,
whose Hugging Face plan gathers and re-splits it, a style AutoTP does not apply). Fused QKV
shapes come from the model's own head counts (``[[q, k, v], -1]``), so a GQA Phi-3 or GLM
splits its q, k and v on head boundaries; every preset also plans the untied LM head as
column-parallel with a gathered output (the training behaviour of DeepSpeed v0.19.7); a tied
one stays whole.
"""

from __future__ import annotations

from collections.abc import Callable

from deepshard.autotp._meta import AutoTPMeta
from deepshard.interface.config import TpLayerSpecConfig
from deepshard.interface.errors import ConfigError

__all__ = ["PRESETS", "preset_specs"]

_ATTN = r".*\.self_attn\."
_MLP = r".*\.mlp\."
_LM_HEAD = TpLayerSpecConfig(
    patterns=[r"(.*\.)?(lm_head|embed_out|output_layer)\.weight$"], gather_output=True
)


def _spec(pattern: str, kind: str = "column", **extra: object) -> TpLayerSpecConfig:
    return TpLayerSpecConfig.model_validate(
        {"patterns": [pattern], "partition_type": kind, **extra}
    )


def _qkv_shape(meta: AutoTPMeta) -> list[int | list[int]]:
    q, kv = meta.q_rows, meta.kv_rows
    return [[q, kv, kv], -1] if q is not None and kv is not None else [3, -1]


def _llama(meta: AutoTPMeta) -> list[TpLayerSpecConfig]:
    return [
        _spec(_ATTN + r"o_proj\.weight$", "row"),
        _spec(_ATTN + r"[qkv]_proj\.weight$"),
        _spec(_MLP + r"down_proj\.weight$", "row"),
        _spec(_MLP + r"(up|gate)_proj\.weight$"),
        _LM_HEAD,
    ]


def _qwen3(meta: AutoTPMeta) -> list[TpLayerSpecConfig]:
    norms = _spec(_ATTN + r"[qk]_norm\.weight$", "skip", grad_allreduce=True)
    return [norms, *_llama(meta)]


def _mixtral(meta: AutoTPMeta) -> list[TpLayerSpecConfig]:
    moe = r".*\.block_sparse_moe\."
    return [
        _spec(_ATTN + r"o_proj\.weight$", "row"),
        _spec(_ATTN + r"[qkv]_proj\.weight$"),
        _spec(moe + r"experts\.\d+\.w2\.weight$", "row"),
        _spec(moe + r"experts\.\d+\.w[13]\.weight$"),
        _spec(moe + r"gate\.weight$", "skip"),
        _LM_HEAD,
    ]


def _deepseek_v2(meta: AutoTPMeta) -> list[TpLayerSpecConfig]:
    return [
        _spec(_ATTN + r"o_proj\.weight$", "row"),
        # Multi-head latent attention: the low-rank down-projections stay whole.
        _spec(_ATTN + r"(q_a_proj|kv_a_proj_with_mqa)\.weight$", "skip"),
        _spec(_ATTN + r"(q_proj|q_b_proj|kv_b_proj)\.weight$"),
        _spec(_MLP + r"(experts\.\d+\.|shared_experts\.)?down_proj\.weight$", "row"),
        _spec(_MLP + r"(experts\.\d+\.|shared_experts\.)?(up|gate)_proj\.weight$"),
        _spec(_MLP + r"gate\.weight$", "skip"),
        _LM_HEAD,
    ]


def _phi3(meta: AutoTPMeta) -> list[TpLayerSpecConfig]:
    return [
        _spec(_ATTN + r"o_proj\.weight$", "row"),
        _spec(_ATTN + r"qkv_proj\.weight$", shape=_qkv_shape(meta), partition_dim=0),
        _spec(_MLP + r"down_proj\.weight$", "row"),
        _spec(_MLP + r"gate_up_proj\.weight$", shape=[2, -1], partition_dim=0),
        _LM_HEAD,
    ]


def _glm4(meta: AutoTPMeta) -> list[TpLayerSpecConfig]:
    # transformers' GLM and GLM-4: the Llama attention (q/k/v with biases), a fused gate_up_proj
    return [
        _spec(_ATTN + r"o_proj\.weight$", "row"),
        _spec(_ATTN + r"[qkv]_proj\.weight$"),
        _spec(_MLP + r"down_proj\.weight$", "row"),
        _spec(_MLP + r"gate_up_proj\.weight$", shape=[2, -1], partition_dim=0),
        _LM_HEAD,
    ]


def _bloom(meta: AutoTPMeta) -> list[TpLayerSpecConfig]:
    # Bloom's query_key_value is laid out head by head: a KV-group split keeps heads whole.
    return [
        _spec(r".*\.self_attention\.dense\.weight$", "row"),
        _spec(r".*\.self_attention\.query_key_value\.weight$"),
        _spec(_MLP + r"dense_4h_to_h\.weight$", "row"),
        _spec(_MLP + r"dense_h_to_4h\.weight$"),
        _LM_HEAD,
    ]


def _chatglm(meta: AutoTPMeta) -> list[TpLayerSpecConfig]:
    return [
        _spec(r".*\.self_attention\.dense\.weight$", "row"),
        _spec(
            r".*\.self_attention\.query_key_value\.weight$",
            shape=_qkv_shape(meta),
            partition_dim=0,
        ),
        _spec(_MLP + r"dense_4h_to_h\.weight$", "row"),
        _spec(_MLP + r"dense_h_to_4h\.weight$", shape=[2, -1], partition_dim=0),
        _LM_HEAD,
    ]


PRESETS: dict[str, Callable[[AutoTPMeta], list[TpLayerSpecConfig]]] = {
    "llama": _llama,
    "qwen2": _llama,
    "qwen3": _qwen3,
    "mixtral": _mixtral,
    "deepseek_v2": _deepseek_v2,
    "phi3": _phi3,
    "bloom": _bloom,
    "chatglm": _chatglm,
    "glm": _glm4,
    "glm4": _glm4,
}
"""Each preset's specs, built from the model's metadata."""


def preset_specs(name: str, meta: AutoTPMeta) -> list[TpLayerSpecConfig]:
    """The layer specs of preset ``name`` for a model with metadata ``meta``.

    Raises:
        ConfigError: For an unknown preset, naming ``tensor_parallel.preset_model``.
    """
    builder = PRESETS.get(name.lower())
    if builder is None:
        known = ", ".join(sorted(PRESETS))
        raise ConfigError(
            f"tensor_parallel.preset_model: no preset {name!r}; choose one of {known}, or give "
            "tensor_parallel.partition_config.layer_specs",
            [("tensor_parallel.preset_model", f"unknown preset {name!r}")],
        )
    return builder(meta)
