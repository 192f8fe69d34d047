"""Who races in `zero.py`, with which config, and which ratios are targets (data only, no torch).

A competitor is a family (``ddp``, ``fsdp2``, ``deepspeed``, ``deepshard``), a ZeRO stage and
an offload mode. Both engines get the same DeepSpeed-style config dict from `engine_config`;
FSDP2 and DDP are built by hand with the same optimizer and hyper-parameters. Stages 1-2 set
``overlap_comm: true`` for both engines: their baseline, DDP, overlaps its all-reduce with
backward. Offload rows
drop ``torch_adam`` so each engine steps with its own CPU Adam (DeepSpeed then builds
``DeepSpeedCPUAdam``; with ``torch_adam`` it would quietly step ``torch.optim.AdamW`` on the
host): that kernel is part of what ZeRO-Offload is, so it is what is raced. FSDP2 has one
offload mode, `CPUOffloadPolicy` (parameters, gradients and optimizer state on the host), so it
races the ``offload-all`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Family = Literal["ddp", "fsdp2", "deepspeed", "deepshard"]
Offload = Literal["none", "optimizer", "all"]
Masters = Literal["fp32", "bf16"]
Measure = Literal["best_s", "rss_delta"]

LR = 1e-3
WEIGHT_DECAY = 0.01  # torch AdamW's default, spelled out: DeepSpeedCPUAdam's default is 0
CLIP = 1.0
DTYPES = ("fp32", "bf16")
_SUFFIX: dict[Offload, str] = {"none": "", "optimizer": "-offload-opt", "all": "-offload-all"}


@dataclass(frozen=True)
class Competitor:
    """One row of the race."""

    family: Family
    """How the model is wrapped."""
    stage: int
    """The ZeRO stage (DDP counts as 0, FSDP2 as 3)."""
    offload: Offload = "none"
    """What lives on the host: nothing, optimizer state, or parameters and optimizer state."""
    masters: Masters = "fp32"
    """The ZeRO masters' dtype: ``bf16`` is DeepSpeed's ``bf16_master_weights_and_grads`` with
    ``bf16_optimizer_states`` (bf16 runs only)."""

    @property
    def name(self) -> str:
        """The row's name, e.g. ``deepshard-3-offload-opt`` or ``deepshard-2-bf16-masters``."""
        if self.family in ("ddp", "fsdp2"):
            return self.family + _SUFFIX[self.offload]
        masters = "-bf16-masters" if self.masters == "bf16" else ""
        return f"{self.family}-{self.stage}{_SUFFIX[self.offload]}{masters}"


_ENGINES: tuple[Family, ...] = ("deepspeed", "deepshard")
_OFFLOADS: tuple[Offload, ...] = ("none", "optimizer", "all")
LINEUP = (
    Competitor("ddp", 0),
    *(Competitor("deepspeed", s) for s in (0, 1, 2)),
    *(Competitor("deepshard", s) for s in (0, 1, 2)),
    Competitor("fsdp2", 3),
    Competitor("fsdp2", 3, "all"),
    *(Competitor(family, 3, offload) for family in _ENGINES for offload in _OFFLOADS),
    *(Competitor(family, 2, masters="bf16") for family in _ENGINES),
)
BY_NAME = {c.name: c for c in LINEUP}


@dataclass(frozen=True)
class Pairing:
    """A ratio the report prints: ``ours`` over ``theirs`` in one measure."""

    ours: str
    """The DeepShard row."""
    theirs: str
    """The competitor it is divided by."""
    measure: Measure
    """``best_s`` (fastest step) or ``rss_delta`` (peak RSS growth per rank)."""
    target: float | None
    """The ratio it must not exceed; ``None``: printed for information only."""


def _time(ours: str, theirs: str, target: float | None) -> Pairing:
    return Pairing(ours, theirs, "best_s", target)


PAIRINGS = (
    *(_time(f"deepshard-{s}", f"deepspeed-{s}", 1.0) for s in (0, 1, 2)),
    _time("deepshard-0", "ddp", 1.1),
    *(_time(f"deepshard-{s}", "ddp", 1.1) for s in (1, 2)),  # issue 10: stages 1-2 <= 1.10x DDP
    _time("deepshard-3", "fsdp2", 0.95),
    _time("deepshard-3", "deepspeed-3", 0.9),
    _time("deepshard-3-offload-opt", "deepspeed-3-offload-opt", 0.9),
    _time("deepshard-3-offload-all", "deepspeed-3-offload-all", None),
    _time("deepshard-3-offload-all", "fsdp2-offload-all", None),
    Pairing("deepshard-3", "fsdp2", "rss_delta", 1.0),
    Pairing("deepshard-3-offload-all", "fsdp2-offload-all", "rss_delta", 1.0),
    Pairing("deepshard-3", "deepspeed-3", "rss_delta", None),
    _time("deepshard-2-bf16-masters", "deepspeed-2-bf16-masters", 1.0),
    Pairing("deepshard-2-bf16-masters", "deepspeed-2-bf16-masters", "rss_delta", None),
    Pairing("deepshard-2-bf16-masters", "deepshard-2", "rss_delta", None),  # what bf16 saves
)


def parse_stages(text: str) -> tuple[int, ...]:
    """``"0-2"``, ``"3"``, ``"0,1,2,3"`` or ``"all"`` as sorted stage numbers.

    Raises:
        ValueError: Not a stage list of 0-3 (the message names ``--stages``).
    """
    if text.strip() == "all":
        return (0, 1, 2, 3)
    stages: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        low, _, high = part.partition("-")
        if not (low.isdigit() and (high or low).isdigit()):
            raise ValueError(f"--stages: {part!r} is not a stage or range; write e.g. 0-2,3")
        stages.update(range(int(low), int(high or low) + 1))
    if not stages or not stages <= {0, 1, 2, 3}:
        raise ValueError(f"--stages: {text!r} must name stages 0 to 3, e.g. 0-2, 3 or all")
    return tuple(sorted(stages))


def select(stages: tuple[int, ...], names: list[str] | None, dtype: str) -> list[Competitor]:
    """The line-up for ``stages``, narrowed to ``names`` when given, in `LINEUP` order.

    DDP is the stage 0-2 baseline and trains in fp32 only (its bf16 would be a bf16 model with
    bf16 optimizer state, not mixed precision), so it is left out under ``bf16``; the bf16-master
    rows need a bf16 model, so they race under ``bf16`` only.

    Raises:
        ValueError: An unknown name, or nothing left to race (the message names the flags).
    """
    unknown = sorted(set(names or ()) - set(BY_NAME))
    if unknown:
        raise ValueError(f"--competitors: unknown {unknown}; choose from {', '.join(BY_NAME)}")
    chosen = [c for c in LINEUP if c.stage in stages and (names is None or c.name in names)]
    if dtype != "fp32":
        chosen = [c for c in chosen if c.family != "ddp"]
    else:
        chosen = [c for c in chosen if c.masters == "fp32"]
    if not chosen:
        raise ValueError(
            f"--stages {','.join(map(str, stages))} with --competitors {names} and --dtype "
            f"{dtype} leaves no competitor; widen one of them"
        )
    return chosen


def engine_config(competitor: Competitor, micro_batch: int, dtype: str) -> dict[str, Any]:
    """The DeepSpeed-style config both engines get for ``competitor``."""
    params: dict[str, Any] = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    zero: dict[str, Any] = {"stage": competitor.stage}
    if competitor.stage in (1, 2):
        # DDP overlaps its bucketed all-reduce with backward, so stages 1-2 race with overlap
        # on (both engines default it off below stage 3). DeepShard's stage 1 overlaps anyway;
        # its stage 2 then keeps two reductions in flight instead of one blocking each hook.
        zero["overlap_comm"] = True
    if competitor.offload == "none":
        params["torch_adam"] = True
    else:
        zero["offload_optimizer"] = {"device": "cpu"}
    if competitor.offload == "all":
        zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
        if competitor.masters == "bf16":
            config["bf16"] |= {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    return config
