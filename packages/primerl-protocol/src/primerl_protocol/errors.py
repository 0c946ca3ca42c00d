"""Turn msgspec's validation messages into (dotted path, detail) for our own errors."""

from __future__ import annotations

import re

_PATH_RE = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def split_validation_error(err: Exception) -> tuple[str, str]:
    """'Expected `int`, got `str` - at `$.a[0].b`' -> ('a[0].b', 'Expected `int`, got `str`').

    "Object contains unknown field `x`" is reported by msgspec at the parent object; the path
    returned names the field itself. The path is "" for the root.
    """
    m = _PATH_RE.match(str(err))
    assert m is not None  # the pattern matches every string (its path part is optional)
    path, detail = (m.group("path") or "").lstrip("."), m.group("detail")
    unknown = re.match(r"Object contains unknown field `([^`]*)`", detail)
    if unknown:
        path = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
    return path, detail
