"""Counting FLOPs off the timed path: the recorded calls replayed on fake tensors.

A Python dispatch mode costs ~10 us per aten operator, so counting while the step runs slows
the step it times. In replay counting the step runs with the module hooks only (latency per
module), and the hook that closes an outermost call records what the call was given: every
tensor argument as its metadata (shape, strides, dtype, device, ``requires_grad``), every other
argument as its value, with the grad mode, the autocast state and the ``training`` flags of the
called module's tree. Calls recorded alike are one *call key* with a multiplicity.

When the numbers are first read, each new key is replayed once: the called module is run
through ``torch.func.functional_call`` with fake copies of its parameters and buffers, on fake
inputs (``FakeTensorMode``: shapes propagate, no kernel runs, no memory is used), under the
counting `Recorder` with hooks on the same module objects, so attribution is the eager one.
Counting backward, the fake outputs are back-propagated too: from the one-element outputs (a
returned loss) when there are any, else from every floating output that requires grad. A
key's counts times its multiplicity, summed, are the profile's.

Nothing real changes: the parameters and buffers the replay writes (BatchNorm's running
statistics, caches) are the fake copies, fake random operators draw nothing from the real
generators, and each module's attribute dictionaries are put back as they were (what a
replayed forward assigns to ``self`` is undone). A call the replay cannot reproduce makes it
fail with the reason: an argument that is neither a tensor nor a plain value (a cache object
would be mutated), a tensor subclass, or an operator whose output shape depends on tensor
values (``nonzero``, ``.item()``: ``DynamicOutputShapeException``,
``DataDependentOutputException``). A model with module hooks of its own is counted eagerly
under ``"auto"`` from the start (`foreign_hooks`): the replay would run them again, and ZeRO-3's
would gather parameters with collectives only this rank issues.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from deepshard.profiler._counting import ModuleTally, Recorder

__all__ = ["CallReplay", "ReplayFailed", "foreign_hooks"]

_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout)
"""Argument types recorded by value (immutable, so the recorded value is the one passed)."""


class ReplayFailed(Exception):
    """The replay cannot reproduce a recorded call (the message says why)."""


@dataclass(frozen=True)
class TensorSpec:
    """The metadata of one tensor argument (its values are not needed to count FLOPs)."""

    shape: tuple[int, ...]
    """Its size."""
    stride: tuple[int, ...]
    """Its strides, so a transposed or sliced input replays with the same layout."""
    dtype: torch.dtype
    """Its element type."""
    device: torch.device
    """Where it lives (a fake tensor keeps the device)."""
    requires_grad: bool
    """Whether backward reaches it (the gradient of an input is backward work)."""


@dataclass(frozen=True)
class CallKey:
    """Everything the FLOPs of one outermost call depend on; equal keys count the same."""

    module_id: int
    """``id`` of the called module (the model, or a submodule called directly)."""
    tree: pytree.TreeSpec
    """The structure of ``(args, kwargs)``."""
    leaves: tuple[Any, ...]
    """Per leaf of ``tree``: a `TensorSpec`, or the plain value passed."""
    training: tuple[bool, ...]
    """``training`` of every module under the called one, in ``modules()`` order."""
    grad_enabled: bool
    """Whether autograd recorded the call (no backward otherwise)."""
    autocast: tuple[bool, torch.dtype] | None
    """Autocast (enabled, dtype) on the device of the first tensor argument, if any."""


def foreign_hooks(model: torch.nn.Module) -> str | None:
    """Which module of ``model`` has forward or backward hooks (a replay would run them again:
    ZeRO-3's parameter gathers would issue collectives), or None."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return "a global module forward hook is registered"
    for name, module in model.named_modules():
        hooks = (
            module._forward_hooks,
            module._forward_pre_hooks,
            module._backward_hooks,
            module._backward_pre_hooks,
        )
        if any(hooks):
            return f"module {name or '(root)'} ({type(module).__name__}) has hooks"
    return None


def call_key(module: torch.nn.Module, args: Any, kwargs: Any) -> CallKey | str:
    """The key of a call of ``module``, or why the call cannot be replayed."""
    leaves, tree = pytree.tree_flatten((args, kwargs))
    specs: list[Any] = []
    device: torch.device | None = None
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if type(leaf) not in (torch.Tensor, torch.nn.Parameter) or leaf.layout != torch.strided:
                return f"an argument is a {type(leaf).__name__} ({leaf.layout}), not a dense tensor"
            device = leaf.device if device is None else device
            specs.append(
                TensorSpec(
                    tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad
                )
            )
        elif isinstance(leaf, _PLAIN):
            specs.append(leaf)
        else:
            return (
                f"an argument of type {type(leaf).__name__} is neither a tensor nor a plain value"
            )
    autocast = None
    if device is not None and device.type in ("cpu", "cuda", "xpu", "mps"):
        kind = device.type
        autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
    return CallKey(
        module_id=id(module),
        tree=tree,
        leaves=tuple(specs),
        training=tuple(m.training for m in module.modules()),
        grad_enabled=torch.is_grad_enabled(),
        autocast=autocast,
    )


@dataclass(frozen=True)
class _KeyCounts:
    tallies: dict[int, ModuleTally]
    ops: dict[str, list[int]]


class CallReplay:
    """The outermost calls of one profile, and their counts replayed when first read.

    Args:
        model: The profiled model (the counting hooks go on all of it).
        ignore_types: Module types that count nothing.
        count_backward: Also replay and count the backward.
    """

    def __init__(
        self, model: torch.nn.Module, *, ignore_types: tuple[type, ...], count_backward: bool
    ) -> None:
        self.model = model
        self._ignore_types = ignore_types
        self._count_backward = count_backward
        self._modules = {id(m): m for m in model.modules()}
        self._calls: collections.Counter[CallKey] = collections.Counter()
        self._counted: dict[CallKey, _KeyCounts] = {}
        self._unreplayable: str | None = None

    def record(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        """Note one finished outermost call of ``module`` (the hooks call this)."""
        key = call_key(module, args, kwargs)
        if isinstance(key, str):
            self._unreplayable = self._unreplayable or key
        else:
            self._calls[key] += 1

    def reset(self) -> None:
        """Forget the recorded calls (replayed counts of a key stay cached)."""
        self._calls.clear()
        self._unreplayable = None

    def counts(self) -> tuple[dict[int, ModuleTally], dict[str, list[int]]]:
        """Per module ``id`` the FLOPs/MACs of every recorded call, and per operator name.

        Raises:
            ReplayFailed: A recorded call cannot be replayed.
        """
        if self._unreplayable is not None:
            raise ReplayFailed(self._unreplayable)
        tallies = {mid: ModuleTally() for mid in self._modules}
        ops: dict[str, list[int]] = {}
        for key, times in self._calls.items():
            if key not in self._counted:
                try:
                    self._counted[key] = self._replay(key)
                except ReplayFailed as error:
                    self._unreplayable = str(error)  # not tried again on the next read
                    raise
            counted = self._counted[key]
            for mid, tally in counted.tallies.items():
                total = tallies[mid]
                total.flops += times * tally.flops
                total.macs += times * tally.macs
                total.backward_flops += times * tally.backward_flops
                total.backward_macs += times * tally.backward_macs
            for name, (forward, backward) in counted.ops.items():
                per_op = ops.setdefault(name, [0, 0])
                per_op[0] += times * forward
                per_op[1] += times * backward
        return tallies, ops

    def _replay(self, key: CallKey) -> _KeyCounts:
        module = self._modules[key.module_id]
        recorder = Recorder(
            self.model,
            ignore_types=self._ignore_types,
            count_backward=self._count_backward,
            synchronize=lambda: None,
        )
        saved = _attributes(self.model)
        try:
            with _training(module, key.training), FakeTensorMode(allow_non_fake_inputs=True):
                state = {name: _fake(t) for name, t in _state(module).items()}
                args, kwargs = pytree.tree_unflatten([_fake(x) for x in key.leaves], key.tree)
                recorder.install()
                try:
                    _run(module, state, args, kwargs, key, backward=self._count_backward)
                finally:
                    recorder.remove()
        except Exception as error:  # any failure: the call is not reproducible this way
            reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise ReplayFailed(f"{type(error).__name__}: {reason}") from error
        finally:
            _restore(saved)
        return _KeyCounts(recorder.tallies, recorder.ops)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name, each tensor object once (tied ones follow)."""
    state: dict[str, torch.Tensor] = dict(module.named_parameters())
    state.update(module.named_buffers())
    for tensor in state.values():
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise ReplayFailed(f"a parameter or buffer is a {type(tensor).__name__}")
    return state


def _fake(value: Any) -> Any:
    """A fake tensor like ``value`` (a tensor or a `TensorSpec`); other values as they are."""
    if isinstance(value, torch.Tensor):
        value = TensorSpec(
            tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad
        )
    if not isinstance(value, TensorSpec):
        return value
    fake = torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device=value.device)
    return fake.requires_grad_(value.requires_grad)


def _run(
    module: torch.nn.Module,
    state: dict[str, torch.Tensor],
    args: Any,
    kwargs: Any,
    key: CallKey,
    *,
    backward: bool,
) -> None:
    with torch.set_grad_enabled(key.grad_enabled), _autocast(key):
        out = torch.func.functional_call(module, state, tuple(args), kwargs, strict=False)
    if not (backward and key.grad_enabled):
        return
    seeds = [
        t
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    # A model that returns its loss (Hugging Face with labels) is back-propagated from it
    # alone, as its caller does: seeding the logits too would add a gradient accumulation.
    losses = [t for t in seeds if t.numel() == 1]
    seeds = losses or seeds
    if seeds:
        torch.autograd.backward(seeds, [torch.ones_like(t) for t in seeds])


def _autocast(key: CallKey) -> Any:
    device = next((s.device for s in key.leaves if isinstance(s, TensorSpec)), None)
    if key.autocast is None or device is None or not key.autocast[0]:
        return torch.autocast("cpu", enabled=False)
    return torch.autocast(device.type, dtype=key.autocast[1])


class _training:
    """Sets the recorded ``training`` flags for the replay and puts the current ones back."""

    def __init__(self, module: torch.nn.Module, flags: tuple[bool, ...]) -> None:
        self._modules = list(module.modules())
        self._flags = flags
        self._now = tuple(m.training for m in self._modules)

    def __enter__(self) -> None:
        for m, flag in zip(self._modules, self._flags, strict=True):
            m.training = flag

    def __exit__(self, *exc: object) -> None:
        for m, flag in zip(self._modules, self._now, strict=True):
            m.training = flag


_Saved = list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any], dict[str, Any]]]


def _attributes(model: torch.nn.Module) -> _Saved:
    return [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m in model.modules()]


def _restore(saved: _Saved) -> None:
    """Put each module's attributes, parameters and buffers back (no fake tensor stays)."""
    for module, attributes, parameters, buffers in saved:
        live_dicts: tuple[dict[str, Any], ...] = (
            module.__dict__,
            module._parameters,
            module._buffers,
        )
        for live, before in zip(live_dicts, (attributes, parameters, buffers), strict=True):
            if live.keys() != before.keys() or any(live[k] is not v for k, v in before.items()):
                live.clear()
                live.update(before)
