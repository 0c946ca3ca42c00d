"""Rules every config section of every package keeps, checked over each command's root."""

import msgspec
import pytest
from msgspec import inspect as mi
from primerl.configs import (
    EvalConfig,
    InferenceRunConfig,
    OrchRunConfig,
    RLConfig,
    SFTConfig,
    TrainerRunConfig,
)
from primerl_protocol.config import field_docs

ROOTS = [RLConfig, SFTConfig, EvalConfig, TrainerRunConfig, OrchRunConfig, InferenceRunConfig]


def _structs(root: type) -> set[type]:
    seen: set[type] = set()

    def walk(t: mi.Type) -> None:
        if isinstance(t, mi.StructType):
            if t.cls in seen:
                return
            seen.add(t.cls)
            for f in t.fields:
                walk(f.type)
        for attr in ("types", "item_type", "value_type"):
            sub = getattr(t, attr, None)
            for s in sub if isinstance(sub, tuple) else [sub] if sub is not None else []:
                walk(s)

    walk(mi.type_info(root))
    return seen


ALL = sorted({cls for root in ROOTS for cls in _structs(root)}, key=lambda c: c.__qualname__)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__qualname__)
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    undocumented = [f.name for f in msgspec.structs.fields(cls) if f.name not in docs]
    assert not undocumented, f"{cls.__qualname__}: fields without a docstring: {undocumented}"


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__qualname__)
def test_optional_fields_default_to_none(cls):
    """TOML has no null, so a dumped config drops None values; loading it back must give the
    same config, which holds only if every field that may be None defaults to None."""
    for f in mi.type_info(cls).fields:
        may_be_none = isinstance(f.type, mi.UnionType) and any(isinstance(t, mi.NoneType) for t in f.type.types)
        if may_be_none and not f.required:
            assert f.default is None, f"{cls.__qualname__}.{f.name} may be None but defaults to {f.default!r}"
