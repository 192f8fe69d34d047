"""Marking a model whose forward runs collectives, so that Hugging Face's `generate` keeps the
ranks in lockstep.

A distributed `generate` in which every rank decodes its own prompts stops each rank when its
own sequences are finished. If the forward runs collectives — the all-to-alls of expert
parallelism, the parameter gathers of ZeRO-3 — the rank that stops first leaves the others
blocked in their next collective until the process group's timeout. transformers has the cure,
``synced_gpus``: a finished rank keeps running forward passes until every rank is done (one
all-reduce of a flag per step). It turns it on by itself only for models it recognises as
sharded: DeepSpeed ZeRO-3 through DeepSpeed's global config, FSDP2 through an attribute on the
model, ``_is_fsdp_managed_module``. transformers reads that attribute only to decide that the
ranks must move together (``synced_gpus`` in `generate`, and no random layer skipping in its
speech models' layerdrop), which is exactly what a collective forward needs; so DeepShard sets it
on the models whose forward it makes collective. A caller's explicit ``synced_gpus=`` still wins.
"""

from __future__ import annotations

import torch

__all__ = ["COLLECTIVE_FORWARD_ATTRIBUTE", "mark_collective_forward"]

COLLECTIVE_FORWARD_ATTRIBUTE = "_is_fsdp_managed_module"
"""The attribute transformers reads (``transformers.distributed.fsdp.is_fsdp_managed_module``)."""


def mark_collective_forward(model: torch.nn.Module) -> None:
    """Tell transformers that ``model``'s forward runs collectives (see the module docstring)."""
    setattr(model, COLLECTIVE_FORWARD_ATTRIBUTE, True)
