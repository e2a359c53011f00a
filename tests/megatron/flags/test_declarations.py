"""The --omnibal* settings declared once (megatron/flags/declarations.py): the training's parser,
`omnibal finetune`'s `lora` keys and the flags the workflow passes all come from the one table,
so a config and the flags it becomes give the run the same settings."""

from __future__ import annotations

import argparse

import pytest

from megatron_omnibal.megatron.flags.args import add_omnibal_args, lora_settings
from megatron_omnibal.megatron.flags.declarations import SETTINGS
from megatron_omnibal.workflow.config import FinetuneConfig, lora_spec
from megatron_omnibal.workflow.train_command import config_flags


def _parse(argv: list[str]) -> argparse.Namespace:
    return add_omnibal_args(argparse.ArgumentParser()).parse_args(["--omnibal", *argv])


def test_every_omnibal_flag_is_declared_once() -> None:
    parser = add_omnibal_args(argparse.ArgumentParser())
    flags = [f for a in parser._actions for f in a.option_strings if f.startswith("--omnibal")]
    declared = [s.flag for s in SETTINGS]
    assert sorted(flags) == sorted(declared) and len(set(declared)) == len(declared)


def test_a_lora_mapping_defaults_as_the_flags_do() -> None:
    assert lora_spec({"rank": 4}) == lora_settings(_parse(["--omnibal-lora-rank", "4"]))


@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"freeze": ("projector", "llm"), "tokenizer": "/tok"},
        {"vit_lr_mult": 0.1, "lora": {"rank": 8, "alpha": 16, "dropout": 0.0,
                                      "targets": ["vit.*"], "train": ["projector"]}},
        {"lora": {"rank": 2}},
    ],
)
def test_the_flags_of_a_config_parse_back_to_its_settings(keys: dict) -> None:
    config = FinetuneConfig(model="m", data="d", output="o", **keys)
    args = _parse(config_flags(config))
    assert args.omnibal_freeze == sorted(config.freeze)
    assert args.omnibal_vit_lr_mult == config.vit_lr_mult
    assert args.omnibal_tokenizer == config.tokenizer
    assert lora_settings(args) == config.lora_spec
