"""Load a config: TOML files composed left to right, then dotted overrides, then validation.

    primerl rl @ base.toml @ small.toml trainer.optimizer.lr=1e-4 --orchestrator.group_size 8

Later files override earlier ones key by key (tables merge, arrays replace); overrides on the
command line come last. The merged tree is validated against a msgspec Struct: an unknown key,
a wrong type or a missing key raises ConfigError with the key's full dotted path, what was
expected, where the value came from (which file, or the command line) and, for a misspelt key,
the nearest valid one. Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import difflib
import re
import tomllib
import typing
from pathlib import Path

import msgspec
from msgspec import inspect as mi

from primerl_protocol.errors import split_validation_error

Provenance = dict[tuple[str, ...], str]
"""Where each leaf value came from: dotted path -> 'file.toml' or 'command line'."""


class ConfigError(ValueError):
    """A config could not be loaded: the message names the key (or file) and what was wrong."""


# ---------------------------------------------------------------------------- arguments


def split_args(args: typing.Sequence[str]) -> tuple[list[Path], list[tuple[str, str]]]:
    """Command-line tokens -> (config files, [(dotted key, raw value)]).

    Accepted: `@ file.toml`, `@file.toml`, `key=value`, `--key=value`, `--key value`.
    """
    files: list[Path] = []
    overrides: list[tuple[str, str]] = []
    tokens = list(args)
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "@":
            if i + 1 >= len(tokens):
                raise ConfigError("`@` must be followed by a config file path")
            files.append(Path(tokens[i + 1]))
            i += 2
            continue
        if tok.startswith("@"):
            files.append(Path(tok[1:]))
        elif tok.startswith("--"):
            key, eq, value = tok[2:].partition("=")
            if not eq:
                if i + 1 >= len(tokens) or tokens[i + 1].startswith("--") or tokens[i + 1] == "@":
                    raise ConfigError(f"option `--{key}` needs a value (`--{key}=VALUE`)")
                value = tokens[i + 1]
                i += 1
            overrides.append((_check_key(key, tok), value))
        elif "=" in tok:
            key, _, value = tok.partition("=")
            overrides.append((_check_key(key, tok), value))
        else:
            raise ConfigError(f"cannot read argument {tok!r}: expected `@ file.toml`, `key=value` or `--key value`")
        i += 1
    return files, overrides


_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*$")


def _check_key(key: str, token: str) -> str:
    if not _KEY_RE.match(key):
        raise ConfigError(f"{token!r}: {key!r} is not a dotted config key such as trainer.optimizer.lr")
    return key


def parse_value(raw: str) -> typing.Any:
    """A command-line value as TOML (`3`, `1e-4`, `true`, `[1, 2]`, `"x"`), else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


# ---------------------------------------------------------------------------- composing


def read_toml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.is_dir():
        raise ConfigError(f"config path is a folder, not a TOML file: {path}")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path}: not UTF-8 text (TOML files are UTF-8): byte {err.start} is {err.object[err.start : err.start + 1]!r}"
        ) from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read: {err.strerror}") from None


def _leaves(tree: dict, prefix: tuple[str, ...] = ()) -> typing.Iterator[tuple[tuple[str, ...], typing.Any]]:
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def merge_into(base: dict, update: dict, source: str, provenance: Provenance) -> None:
    """Deep-merge `update` into `base` in place (tables merge, everything else replaces)."""
    for path, value in _leaves(update):
        set_path(base, path, value, source)
        # A replaced subtree forgets where its old leaves came from.
        for old in [p for p in provenance if p[: len(path)] == path and p != path]:
            del provenance[old]
        provenance[path] = source


def set_path(tree: dict, path: tuple[str, ...], value: typing.Any, source: str = "") -> None:
    node = tree
    for i, key in enumerate(path[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            where = ".".join(path[: i + 1])
            raise ConfigError(f"{source}: cannot set `{'.'.join(path)}`: `{where}` is not a table")
        node = child
    node[path[-1]] = value


def compose(
    files: typing.Sequence[Path],
    overrides: typing.Sequence[tuple[str, str]],
    root: type | None = None,
) -> tuple[dict, Provenance]:
    """Merge files then overrides. With `root`, raw override strings go to `str` fields as is."""
    tree: dict = {}
    provenance: Provenance = {}
    for path in files:
        merge_into(tree, read_toml(path), str(path), provenance)
    for key, raw in overrides:
        path = tuple(key.replace("-", "_").split("."))
        value = parse_value(raw)
        if root is not None and not isinstance(value, str) and _wants_str(root, path):
            value = raw
        merge_into(tree, _nest(path, value), f"command line `{key}={raw}`", provenance)
    return tree, provenance


def _nest(path: tuple[str, ...], value: typing.Any) -> dict:
    out: dict = {}
    set_path(out, path, value)
    return out


# ---------------------------------------------------------------------------- validating


def _struct_of(t: mi.Type, data: typing.Any) -> mi.StructType | None:
    """The Struct type that `data` (a table) will be validated as, if any."""
    if isinstance(t, mi.StructType):
        return t
    if isinstance(t, mi.UnionType):
        structs = [s for s in t.types if isinstance(s, mi.StructType)]
        if len(structs) == 1:
            return structs[0]
        for s in structs:  # tagged unions: pick by tag
            if s.tag_field and isinstance(data, dict) and data.get(s.tag_field) == s.tag:
                return s
    return None


def _children(t: mi.Type, data: typing.Any) -> typing.Iterator[tuple[str, mi.Type, typing.Any]]:
    """(key, expected type, value) of the items of a table or array we can check further."""
    s = _struct_of(t, data)
    if s is not None and isinstance(data, dict):
        by_name = {f.encode_name: f.type for f in s.fields}
        for key, value in data.items():
            if key in by_name:
                yield key, by_name[key], value
        return
    if isinstance(t, (mi.ListType, mi.VarTupleType)) and isinstance(data, list):
        for i, value in enumerate(data):
            yield f"[{i}]", t.item_type, value
    elif isinstance(t, mi.DictType) and isinstance(data, dict):
        for key, value in data.items():
            yield key, t.value_type, value
    elif isinstance(t, mi.UnionType):
        for member in t.types:
            yield from _children(member, data)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}{key}" if key.startswith("[") or not prefix else f"{prefix}.{key}"


def find_unknown_keys(root: type, data: dict) -> list[tuple[str, list[str]]]:
    """[(dotted path of an unknown key, the valid keys at that level)] for a config tree."""
    found: list[tuple[str, list[str]]] = []

    def walk(t: mi.Type, value: typing.Any, prefix: str) -> None:
        s = _struct_of(t, value)
        if s is not None and isinstance(value, dict):
            valid = [f.encode_name for f in s.fields] + ([s.tag_field] if s.tag_field else [])
            for key in value:
                if key not in valid:
                    found.append((_join(prefix, key), valid))
        for key, child_t, child in _children(t, value):
            walk(child_t, child, _join(prefix, key))

    walk(mi.type_info(root), data, "")
    return found


def _type_at(root: type, path: typing.Sequence[str]) -> mi.Type | None:
    """The declared type of the key at `path` below `root` (None if there is no such key)."""
    t: mi.Type | None = mi.type_info(root)
    for key in path:
        s = _struct_of(t, {}) if t is not None else None
        if s is None:
            return None
        t = next((f.type for f in s.fields if f.encode_name == key), None)
    return t


def _wants_str(root: type, path: tuple[str, ...]) -> bool:
    t = _type_at(root, path)
    members = t.types if isinstance(t, mi.UnionType) else (t,)
    return any(isinstance(m, mi.StrType) for m in members)


def _source(provenance: Provenance, dotted: str) -> str:
    parts = tuple(p for p in re.split(r"\.|\[\d+\]", dotted) if p)
    for n in range(len(parts), 0, -1):
        if parts[:n] in provenance:
            return provenance[parts[:n]]
        below = [src for p, src in provenance.items() if p[:n] == parts[:n]]
        if below:
            return below[0]
    return "defaults"


def validate(root: type, data: dict, provenance: Provenance | None = None) -> typing.Any:
    """Convert a merged tree into `root`, or raise ConfigError naming the key and the source."""
    provenance = provenance or {}
    problems = []
    for path, valid in find_unknown_keys(root, data):
        leaf = path.rsplit(".", 1)[-1]
        near = difflib.get_close_matches(leaf, valid, n=1, cutoff=0.6)
        hint = f"; did you mean `{path[: -len(leaf)]}{near[0]}`?" if near else f"; valid keys here: {', '.join(valid)}"
        problems.append(f"unknown key `{path}` (from {_source(provenance, path)}){hint}")
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        return msgspec.convert(data, root, strict=True)
    except msgspec.ValidationError as err:
        path, detail = split_validation_error(err)
        missing = re.match(r"Object missing required field `([^`]*)`", detail)
        if missing:
            full = _join(path, missing.group(1))
            raise ConfigError(f"missing required key `{full}`{_table_hint(root, full)}") from None
        got = _lookup(data, path)
        detail = detail.replace("`", "")
        detail = detail[0].lower() + detail[1:] if detail else detail
        shown = f" (value {got!r} from {_source(provenance, path)})" if got is not _MISSING and path else ""
        raise ConfigError(f"config key `{path or '<root>'}`: {detail}{shown}") from None


_MISSING = object()


def _table_hint(root: type, dotted: str) -> str:
    """' (a table; required keys: name)' when the missing key is a section."""
    t = _type_at(root, dotted.split("."))
    s = _struct_of(t, {}) if t is not None else None
    if s is None:
        return ""
    required = [f.encode_name for f in s.fields if f.required]
    return f" (a table [{dotted}]; required keys: {', '.join(required) or 'none'})"


def _lookup(data: typing.Any, dotted: str) -> typing.Any:
    node = data
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", dotted):
        try:
            node = node[int(part[1:-1])] if part.startswith("[") else node[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return _MISSING
    return node


def load_config(root: type, args: typing.Sequence[str] = ()) -> typing.Any:
    """The whole pipeline: arguments -> files + overrides -> merged tree -> validated `root`."""
    files, overrides = split_args(args)
    data, provenance = compose(files, overrides, root)
    return validate(root, data, provenance)
