"""docs/config-reference.md is generated from the config Structs and must match them."""

from pathlib import Path

from msgspec import inspect as mi
from primerl.config_reference import render, type_name
from primerl.configs import RLConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"


def test_the_page_is_up_to_date():
    assert PAGE.read_text() == render(), (
        "docs/config-reference.md is stale: run `uv run python -m primerl.config_reference > docs/config-reference.md`"
    )


def test_every_key_of_the_rl_config_is_on_the_page():
    page = render()

    def keys(t: mi.Type, prefix: str):
        for f in t.fields:
            sub, key = f.type, f"{prefix}{f.encode_name}"
            if isinstance(sub, mi.StructType):
                yield from keys(sub, key + ".")
            elif isinstance(sub, mi.ListType) and isinstance(sub.item_type, mi.StructType):
                yield from keys(sub.item_type, key + "[].")
            else:
                yield key

    missing = [k for k in keys(mi.type_info(RLConfig), "") if f"| `{k}` |" not in page]
    assert not missing, missing


def test_types_and_defaults_read_as_written():
    page = render()
    assert "| `orchestrator.max_async_level` | int (>= 0) | `1` |" in page
    assert (
        "| `transport.sockets.recv_timeout_s` | float | `1800.0` |" in page
    )  # the run configs' default, not the class's inf
    assert "| `model.name` | str | required |" in page
    assert type_name(mi.UnionType((mi.IntType(), mi.NoneType()))) == "int \\| none"
