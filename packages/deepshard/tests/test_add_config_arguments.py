"""``add_config_arguments`` adds DeepSpeed's config flags, in their own group, to the parser."""

from __future__ import annotations

import argparse

import deepshard.engine as ds


def test_the_flags_parse_as_deepspeeds_do() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    assert ds.add_config_arguments(parser) is parser
    defaults = parser.parse_args([])
    assert (defaults.deepspeed, defaults.deepspeed_config, defaults.deepshard_config) == (
        False,
        None,
        None,
    )
    given = parser.parse_args(
        ["--deepspeed", "--deepspeed_config", "a.json", "--deepshard_config", "b.json"]
    )
    assert (given.deepspeed, given.deepspeed_config, given.deepshard_config) == (
        True,
        "a.json",
        "b.json",
    )
    assert given.epochs == 1


def test_the_flags_live_in_their_own_argument_group() -> None:
    parser = ds.add_config_arguments(argparse.ArgumentParser())
    groups = {
        group.title: {action.dest for action in group._group_actions}
        for group in parser._action_groups
    }
    assert groups["DeepShard"] == {"deepspeed", "deepspeed_config", "deepshard_config"}
    assert "--deepspeed_config" in parser.format_help()
