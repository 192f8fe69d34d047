"""``torch.compile`` and the engine: ``engine.compile()`` and models compiled before ``initialize``.

Two ways in, as in DeepSpeed:

* ``engine.compile(backend=..., compile_kwargs=...)`` compiles the whole module in place
  (``module.compile(...)``, so ``engine.module`` stays the user's object and its forward runs
  compiled from then on).
* ``initialize(torch.compile(model), ...)``: the ``OptimizedModule`` wrapper is split off. ZeRO,
  the optimizer, the placements and the state dicts see the real module (its parameter names
  without the wrapper's ``_orig_mod.`` prefix, stage 3's units hooked on the real submodules),
  and the engine's forward calls the wrapper, so the user's compile settings are kept.

At ZeRO stage 3 the gather/release hooks run outside every traced graph
(`deepshard.zero` wraps them so dynamo breaks the graph there and runs them eagerly). Compiling
the whole module therefore breaks the graph at each unit boundary: every unit's forward is its
own graph, traced once while its parameters are gathered (stable shapes and strides), and
dynamo guards only on the module structure, never on the storages gather/release resize. A
``fullgraph=True`` compile cannot hold those breaks and is refused at stage 3.

Recognising an ``OptimizedModule`` needs ``torch._dynamo``; it is looked up in ``sys.modules``
(a compiled model means it is loaded), so ``initialize`` of an eager model never imports it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from deepshard.interface.errors import ConfigError

if TYPE_CHECKING:
    from deepshard.engine._engine import EngineParts

__all__ = ["DEFAULT_BACKEND", "EngineCompile", "check_compile_request", "split_compiled"]

DEFAULT_BACKEND = "inductor"
"""``torch.compile``'s own default (DeepSpeed's CPU and CUDA accelerators answer the same)."""

_log = logging.getLogger("deepshard.engine")


def split_compiled(
    model: torch.nn.Module, *, stage: int
) -> tuple[torch.nn.Module, Callable[..., Any] | None]:
    """The module to train and, for a ``torch.compile(model)`` wrapper, the compiled call.

    Args:
        model: What ``initialize`` was given.
        stage: The ZeRO stage (stage 3 cannot run a ``fullgraph=True`` compile).

    Returns:
        ``(model, None)`` for a plain module; ``(inner, wrapper)`` for an ``OptimizedModule``
        (nested wrappers unwrapped to the innermost module, the outermost wrapper called).

    Raises:
        ConfigError: A ``fullgraph=True`` wrapper at stage 3.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:  # nothing was compiled in this process
        return model, None
    optimized = dynamo.eval_frame.OptimizedModule
    if not isinstance(model, optimized):
        return model, None
    if stage == 3 and getattr(getattr(model, "dynamo_ctx", None), "fullgraph", False):
        raise ConfigError(
            "initialize got torch.compile(model, fullgraph=True) at zero_optimization.stage 3: "
            "the gather/release hooks break the graph at every unit; compile without "
            "fullgraph (each unit is still one graph)"
        )
    inner: torch.nn.Module = model
    while isinstance(inner, optimized):
        inner = inner._orig_mod
    return inner, model


def check_compile_request(
    *,
    stage: int,
    compile_kwargs: Mapping[str, Any],
    schedule: Any,
    compiled_autograd_enabled: bool,
) -> dict[str, Any]:
    """The keyword arguments ``module.compile`` gets, or a typed error for what cannot work.

    Raises:
        ConfigError: A DeepCompile ``schedule``; ``compiled_autograd_enabled`` (ZeRO's backward
            hooks run in the eager autograd engine); ``fullgraph=True`` at stage 3, whose
            gather/release hooks break the graph at every unit.
    """
    if schedule is not None:
        raise ConfigError(
            "engine.compile(schedule=...) is a DeepCompile schedule; DeepShard does not carry "
            "DeepCompile, so call engine.compile() without schedule"
        )
    if compiled_autograd_enabled:
        raise ConfigError(
            "engine.compile(compiled_autograd_enabled=True): ZeRO reduces gradients from hooks "
            "in the eager autograd engine, which compiled autograd would trace; leave it False"
        )
    kwargs = dict(compile_kwargs)
    if "backend" in kwargs:
        _log.warning(
            "engine.compile: compile_kwargs['backend'] is overridden by backend=; pass the "
            "backend as that argument"
        )
        del kwargs["backend"]
    if stage == 3 and kwargs.get("fullgraph"):
        raise ConfigError(
            "engine.compile(compile_kwargs={'fullgraph': True}) at zero_optimization.stage 3: "
            "the gather/release hooks break the graph at every unit; drop fullgraph (each unit "
            "is still one graph)"
        )
    return kwargs


class EngineCompile:
    """``compile`` and ``is_compiled`` of `DeepShardEngine` (a mixin: the engine sets the
    attributes)."""

    module: torch.nn.Module
    parts: EngineParts
    _is_compiled: bool

    def compile(
        self,
        backend: Any = DEFAULT_BACKEND,
        compile_kwargs: Mapping[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile the module's forward with ``torch.compile`` (DeepSpeed's ``engine.compile``).

        The whole module is compiled in place (``module.compile``); at ZeRO stage 3 the graph
        breaks at each unit's gather/release hooks (`deepshard.engine._compile`). A second
        call, or a model that came compiled, does nothing.

        Args:
            backend: The ``torch.compile`` backend (a name or a callable).
            compile_kwargs: Other ``torch.compile`` arguments (``mode``, ``dynamic``...).
            schedule: DeepCompile's schedule; refused (DeepShard has no DeepCompile).
            compiled_autograd_enabled: Refused when True (ZeRO's hooks need eager autograd).

        Raises:
            ConfigError: ``schedule``, ``compiled_autograd_enabled``, or ``fullgraph`` at
                stage 3.
        """
        kwargs = check_compile_request(
            stage=self.parts.config.zero_optimization.stage,
            compile_kwargs=compile_kwargs or {},
            schedule=schedule,
            compiled_autograd_enabled=compiled_autograd_enabled,
        )
        if self._is_compiled:
            return
        self.module.compile(backend=backend, **kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether the forward runs compiled (`compile` was called, or the model came so)."""
        return self._is_compiled
