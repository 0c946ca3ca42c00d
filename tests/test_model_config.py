"""Config keys that name model options stay in step with primerl-models."""

import typing

import msgspec
from primerl_models import BACKENDS
from primerl_trainer.config import TrainerConfig


def test_attention_choices_are_the_backends_models_implement():
    field = next(f for f in msgspec.structs.fields(TrainerConfig) if f.name == "attention")
    assert set(typing.get_args(field.type)) == set(BACKENDS)
