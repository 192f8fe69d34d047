"""The README's example runs as written in a fresh interpreter and prints the plan it says."""

from __future__ import annotations

from pathlib import Path

from deepshard.autotp import grain_split, kv_group_split
from deepshard.testing import run_readme_example

README = Path(__file__).parents[1] / "README.md"


def test_the_readme_example_prints_its_plan() -> None:
    header, *lines, last = run_readme_example(README, timeout_s=120).splitlines()
    assert header == "AutoTP plan: tp_size=2, 6 modules"
    rows = {line.split()[0]: line.split(maxsplit=1)[1] for line in lines}
    # 12 query heads and 3 KV heads of 64: rank 0 holds two KV groups, rank 1 one.
    q, kv = kv_group_split(12 * 64, 2, 3), kv_group_split(3 * 64, 2, 3)
    assert rows["layers.0.self_attn.q_proj"].split("  ")[0] == "column"
    assert str(list(q)) in rows["layers.0.self_attn.q_proj"]
    assert str(list(kv)) in rows["layers.0.self_attn.k_proj"]
    assert str(list(q)) in rows["layers.0.self_attn.o_proj"]
    half = str(list(grain_split(96, 2)))
    assert f"[{half}, {half}]" in rows["layers.0.mlp.gate_up_proj"]
    assert rows["layers.0.mlp.down_proj"].startswith("row")
    assert last.split() == [
        "layers.0.mlp.down_proj",
        "replicate",
        "-",
        "partition_config.layer_specs[0]",
    ]
