"""`init_inference` and `InferenceEngine`: a model ready for evaluation and generation.

The engine casts the model to the configured dtype, puts it in eval mode, optionally splits it
over a tensor-parallel group through a `deepshard.interface.ModelParallelizer` (this package
never imports AutoTP; ``deepshard.engine.init_inference`` passes one), loads a safetensors
checkpoint, and generates by continuous batching (`generate_requests`, under
``torch.inference_mode()``: the engine's model is for evaluation) over DeepShard's own static
KV cache. ``generate`` takes and returns padded batches like Hugging Face's.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepshard.inference._checkpoint import load_checkpoint
from deepshard.inference._config import resolve_config
from deepshard.inference._loop import generate_requests
from deepshard.inference._profile import GenerationProfile
from deepshard.inference._sampling import GenerationRequest, GenerationResult
from deepshard.interface import ConfigError, ModelParallelizer, ParallelizedModel
from deepshard.interface.config import InferenceConfig

__all__ = ["InferenceEngine", "init_inference"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _check_cuda_graph(config: InferenceConfig, tp_size: int) -> None:
    """``enable_cuda_graph`` is refused everywhere, with the reason that applies here."""
    if not config.enable_cuda_graph:
        return
    if not torch.cuda.is_available():
        reason = "it needs a CUDA device and none is available"
    elif tp_size > 1:
        reason = "the decode step's tensor-parallel collectives are not captured (tp_size > 1)"
    else:
        reason = "capturing the decode step is not implemented yet"
    raise ConfigError(
        f"enable_cuda_graph cannot be honoured: {reason}; set enable_cuda_graph=False",
        [("enable_cuda_graph", reason)],
    )


class InferenceEngine:
    """A model in eval mode with ``engine(*args)`` forward and a continuous-batching ``generate``.

    Build it with `init_inference` (or ``deepshard.engine.init_inference`` for tensor
    parallelism). Under tensor parallelism every rank must call ``generate`` with the same
    inputs: greedy decoding is deterministic, and sampling seeds are broadcast from the group's
    first rank, so every rank runs the same forwards.
    """

    def __init__(self, parallel: ParallelizedModel, config: InferenceConfig) -> None:
        self.module: nn.Module = parallel.module
        self.config = config
        self._parallel = parallel
        self._profile = GenerationProfile() if config.enable_profiling else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward."""
        return self.module(*args, **kwargs)

    def profile_summary(self) -> dict[str, float | int] | None:
        """Timings and counts of the generates so far; None unless ``enable_profiling``."""
        return self._profile.summary() if self._profile is not None else None

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None = None,
        temperature: float = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
        do_sample: bool = False,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Generates for a padded batch; returns ``[batch, prompt_len + new]`` like HF generate.

        Each row's padding (``attention_mask`` 0) is stripped to form one request; rows are
        decoded together by continuous batching. Prompts are kept as given, new tokens appended,
        rows that finished early padded with ``pad_token_id``.

        Raises:
            ConfigError: A prompt plus ``max_new_tokens`` exceeds ``max_out_tokens``, no pad
                token can be found, or the shapes disagree.
        """
        ids = _as_batch(input_ids)
        mask = _as_mask(attention_mask, ids)
        eos = _eos_ids(self.module, eos_token_id)
        pad = _pad_id(self.module, pad_token_id, eos)
        base_seed = self._shared_seed(seed) if do_sample else None
        prompts = [tuple(row[keep].tolist()) for row, keep in zip(ids, mask.bool(), strict=True)]
        requests = [
            GenerationRequest(
                request_id=index,
                prompt=prompt,
                max_new_tokens=self._budget(len(prompt), max_new_tokens),
                eos_token_id=eos,
                do_sample=do_sample,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=None if base_seed is None else base_seed + index,
            )
            for index, prompt in enumerate(prompts)
        ]
        results = generate_requests(
            self.module,
            requests,
            max_batch_size=self.config.max_batch_size or len(requests),
            pad_token_id=pad,
            kv_heads=self._parallel.kv_heads,
            profile=self._profile,
            inference_mode=True,  # an inference engine's model is not trained after
        )
        return _padded(ids, results, pad)

    def _budget(self, prompt_len: int, max_new_tokens: int | None) -> int:
        limit = self.config.max_out_tokens
        new = limit - prompt_len if max_new_tokens is None else max_new_tokens
        if new <= 0 or prompt_len + new > limit:
            raise ConfigError(
                f"a prompt of {prompt_len} tokens plus {new} new ones does not fit "
                f"max_out_tokens={limit}; raise max_out_tokens or lower max_new_tokens",
                [("max_out_tokens", f"{prompt_len} + {new} > {limit}")],
            )
        return new

    def _shared_seed(self, seed: int | None) -> int:
        """The sampling seed; under TP the group's first rank's, so every rank samples alike."""
        value = random.randrange(2**31) if seed is None else seed
        group = self._parallel.group
        if self._parallel.tp_size > 1 and group is not None:
            box = torch.tensor([value], dtype=torch.int64)
            dist.broadcast(box, src=dist.get_global_rank(group, 0), group=group)
            value = int(box.item())
        return value


def _as_batch(input_ids: torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.numel() == 0:
        raise ConfigError(
            f"input_ids must be [batch, length] and non-empty, got shape {tuple(ids.shape)}",
            [("input_ids", "pass a 2-D tensor of token ids")],
        )
    return ids.to(torch.long).cpu()


def _as_mask(attention_mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones_like(ids)
    mask = torch.as_tensor(attention_mask).reshape(ids.shape[0], -1).cpu()
    if mask.shape != ids.shape:
        raise ConfigError(
            f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}",
            [("attention_mask", "give one mask entry per token")],
        )
    return mask


def _generation_attr(module: nn.Module, name: str) -> Any:
    for source in (getattr(module, "generation_config", None), getattr(module, "config", None)):
        value = getattr(source, name, None)
        if value is not None:
            return value
    return None


def _eos_ids(module: nn.Module, eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
    value = eos_token_id if eos_token_id is not None else _generation_attr(module, "eos_token_id")
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _pad_id(module: nn.Module, pad_token_id: int | None, eos: tuple[int, ...]) -> int:
    value = pad_token_id if pad_token_id is not None else _generation_attr(module, "pad_token_id")
    if value is None and eos:
        value = eos[0]
    if value is None:
        raise ConfigError(
            "generate needs a pad token and neither pad_token_id nor eos_token_id is known",
            [("pad_token_id", "pass pad_token_id= (or eos_token_id=) to generate")],
        )
    return int(value)


def _padded(ids: torch.Tensor, results: list[GenerationResult], pad: int) -> torch.Tensor:
    longest = max(len(result.tokens) for result in results)
    out = torch.full((ids.shape[0], ids.shape[1] + longest), pad, dtype=torch.long)
    out[:, : ids.shape[1]] = ids
    for row, result in enumerate(results):
        out[row, ids.shape[1] : ids.shape[1] + len(result.tokens)] = torch.tensor(result.tokens)
    return out


def _prepare(model: nn.Module, config: InferenceConfig) -> nn.Module:
    if config.dtype is not None:
        model = model.to(_DTYPES[config.dtype])
    if not config.keep_module_on_host and torch.cuda.is_available():
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    return model.eval()


def init_inference(
    model: nn.Module,
    config: InferenceConfig | Mapping[str, Any] | None = None,
    *,
    parallelizer: ModelParallelizer | None = None,
    **kwargs: Any,
) -> InferenceEngine:
    """Wraps ``model`` for inference: dtype, eval mode, tensor parallelism, checkpoint.

    Args:
        model: A model (Hugging Face causal LMs generate with DeepShard's cache).
        config: An `InferenceConfig` or a dict of DeepSpeed ``init_inference`` keys.
        parallelizer: Splits the model when ``tensor_parallel.tp_size`` > 1;
            ``deepshard.engine.init_inference`` passes AutoTP's.
        **kwargs: Config keys; one also in ``config`` must have the same value.

    Returns:
        The engine.

    Raises:
        ConfigError: An invalid or conflicting config, ``tp_size`` > 1 without a parallelizer,
            ``enable_cuda_graph`` where it cannot be honoured.
    """
    resolved = resolve_config(config, kwargs)
    tp_size = resolved.tensor_parallel.size
    _check_cuda_graph(resolved, tp_size)
    if tp_size > 1 and parallelizer is None:
        raise ConfigError(
            f"tensor_parallel.tp_size={tp_size} needs a parallelizer; call "
            "deepshard.engine.init_inference (it splits the model with AutoTP)",
            [("tensor_parallel.tp_size", "use deepshard.engine.init_inference for TP > 1")],
        )
    module = _prepare(model, resolved)
    if tp_size > 1 and parallelizer is not None:
        parallel = parallelizer.parallelize(module, tp_size, resolved.tensor_parallel.tp_grain_size)
        if resolved.checkpoint is not None:
            parallelizer.load_checkpoint(parallel, resolved.checkpoint)
    else:
        if resolved.checkpoint is not None:
            load_checkpoint(module, resolved.checkpoint)
        parallel = ParallelizedModel(module=module, tp_size=1, tp_rank=0)
    parallel.module.eval()
    return InferenceEngine(parallel, resolved)
