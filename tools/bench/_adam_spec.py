"""What `adam.py` races: the competitors' names, the shared hyper-parameters, the byte count.

Kept free of torch so that the parent process, which only spawns workers and prints, starts fast.
"""

from __future__ import annotations

NAMES = ("deepshard", "deepspeed", "torch-fused", "torch-foreach")
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
HYPER_PARAMETERS = f"AdamW lr={LR} betas={BETAS} eps={EPS} weight_decay={WEIGHT_DECAY}"
# One fp32 step reads p, g, m, v and writes p, m, v to the lines it has just read: 7 x 4 bytes,
# with no write-allocate traffic to add.
BYTES_PER_PARAM = 28
# Parameter (and gradient) dtypes `--dtype` takes; the moments stay fp32 (DeepSpeed's default).
DTYPES = ("fp32", "bf16", "fp16")


def bytes_per_param(dtype: str) -> int:
    """Bytes one step moves per parameter: p and g in ``dtype``, fp32 m and v, p/m/v written."""
    width = 4 if dtype == "fp32" else 2
    return 3 * width + 16
