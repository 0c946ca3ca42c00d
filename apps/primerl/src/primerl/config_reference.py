"""docs/config-reference.md, generated from the config Structs: every key of every command
with its type, default and docstring. A test fails when the page is stale.

    uv run python -m primerl.config_reference > docs/config-reference.md
"""

from __future__ import annotations

import json
import typing

import msgspec
from msgspec import inspect as mi
from primerl_protocol.config import class_doc, field_docs

from primerl.configs import EvalConfig, InferenceRunConfig, OrchRunConfig, RLConfig, SFTConfig, TrainerRunConfig

COMMANDS: list[tuple[str, type]] = [
    ("primerl rl", RLConfig),
    ("primerl sft", SFTConfig),
    ("primerl eval", EvalConfig),
    ("primerl-orch", OrchRunConfig),
    ("primerl-trainer", TrainerRunConfig),
    ("primerl-inference", InferenceRunConfig),
]


def _bounds(t: mi.Type) -> str:
    parts = []
    for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        value = getattr(t, attr, None)
        if value is not None:
            parts.append(f"{sym} {value}")
    return f" ({', '.join(parts)})" if parts else ""


def type_name(t: mi.Type) -> str:
    """A short, readable name of a field's type."""
    match t:
        case mi.BoolType():
            return "bool"
        case mi.IntType():
            return "int" + _bounds(t)
        case mi.FloatType():
            return "float" + _bounds(t)
        case mi.StrType():
            return "str"
        case mi.NoneType():
            return "none"
        case mi.AnyType():
            return "any"
        case mi.LiteralType():
            return " \\| ".join(json.dumps(v) for v in t.values)
        case mi.UnionType():
            return " \\| ".join(type_name(s) for s in t.types)
        case mi.ListType():
            return f"list[{type_name(t.item_type)}]"
        case mi.TupleType():
            return f"[{', '.join(type_name(s) for s in t.item_types)}]"
        case mi.DictType():
            return f"table of {type_name(t.value_type)}"
        case mi.StructType():
            return "table"
    return type(t).__name__.removesuffix("Type").lower()


def _value_text(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return f"`{value}`"
    return f"`{json.dumps(msgspec.to_builtins(value))}`"


def _default(field: mi.Field):
    """The field's default value (msgspec.NODEFAULT when required)."""
    if field.required:
        return msgspec.NODEFAULT
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return field.default


def _sections(t: mi.StructType, path: str, instance) -> typing.Iterator[tuple[str, mi.StructType, object]]:
    """(dotted path, struct, its default instance or None) of a config and every table below it.

    A table's defaults are those of the instance its parent defaults to (a parent may set
    other defaults than the table's own class: TransportConfig's sockets wait 1800 s)."""
    yield path, t, instance
    for f in t.fields:
        sub = f.type
        if isinstance(sub, mi.ListType) and isinstance(sub.item_type, mi.StructType):
            yield from _sections(sub.item_type, f"{path}.{f.encode_name}[]".lstrip("."), None)
        elif isinstance(sub, mi.StructType):
            child = getattr(instance, f.name) if instance is not None else _default(f)
            yield from _sections(
                sub, f"{path}.{f.encode_name}".lstrip("."), None if child is msgspec.NODEFAULT else child
            )
        elif (table := _optional_table(sub)) is not None:  # off by default; its keys when given
            yield from _sections(table, f"{path}.{f.encode_name}".lstrip("."), None)


def _optional_table(t) -> mi.StructType | None:
    """The table of a `Table | None` field (e.g. trainer.lora), else None."""
    if isinstance(t, mi.UnionType):
        tables = [x for x in t.types if isinstance(x, mi.StructType)]
        if len(tables) == 1 and len(t.types) == 2 and any(isinstance(x, mi.NoneType) for x in t.types):
            return tables[0]
    return None


def _table(path: str, t: mi.StructType, instance, unused: tuple[str, ...] = ()) -> list[str]:
    """The rows of a table's keys; those in `unused` (the root's UNUSED) marked."""
    docs = field_docs(t.cls)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in t.fields:
        sub = f.type
        if isinstance(sub, mi.StructType) or (
            isinstance(sub, mi.ListType) and isinstance(sub.item_type, mi.StructType)
        ):
            continue  # its own table below
        key = f"{path}.{f.encode_name}" if path else f.encode_name
        doc = " ".join(docs.get(f.name, "").split()).replace("|", "\\|")
        if key in unused:
            doc = f"*Unused by this command.* {doc}"
        value = getattr(instance, f.name) if instance is not None else _default(f)
        default = "required" if value is msgspec.NODEFAULT else _value_text(value)
        rows.append(f"| `{key}` | {type_name(sub)} | {default} | {doc} |")
    return rows if len(rows) > 2 else []


def render() -> str:
    out = [
        "# Config reference",
        "",
        "Every key of every command, generated from the config Structs by",
        "`python -m primerl.config_reference` (a test fails when this page is stale). How",
        "configs are composed and overridden: [configs.md](configs.md). `[[...]]` is an array",
        "of tables: `envs.train[].id` is the `id` of each `[[envs.train]]` entry.",
        "",
    ]
    documented: set[tuple[str, type]] = set()
    for command, root in COMMANDS:
        out += [f"## `{command}`", "", class_doc(root), ""]
        unused = getattr(root, "UNUSED", ())
        if unused:
            out += [
                f"Accepted, as a run's config may hold them, but unused by this command: "
                f"{', '.join(f'`{k}`' for k in unused)}.",
                "",
            ]
        info = mi.type_info(root)
        assert isinstance(info, mi.StructType), f"{command}: its config {root.__name__} is not a msgspec Struct"
        for path, struct, instance in _sections(info, "", None):
            if path and (path, struct.cls) in documented:
                continue
            rows = _table(path, struct, instance, unused)
            if not rows:
                continue
            title = (f"`[[{path[:-2]}]]`" if path.endswith("[]") else f"`[{path}]`") if path else "top level"
            doc = class_doc(struct.cls)
            out += [f"### {title}", ""] + ([doc, ""] if doc and path else []) + rows + [""]
            if path:
                documented.add((path, struct.cls))
        out += ["Sections listed above for another command (same key, same meaning) are not repeated.", ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
