"""Field docstrings of config Structs, read from their source (Python keeps none at runtime).

A config field documents itself with a string literal on the line under it:

    lr: float = 1e-6
    \"\"\"Peak learning rate.\"\"\"

`field_docs` finds those strings; `--help` and the generated docs use them.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import msgspec


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} for a Struct class and its bases (subclass docs win)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, msgspec.Struct) or not isinstance(klass, type):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        stmts = body.body
        for stmt, nxt in zip(stmts, stmts[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def class_doc(cls: type) -> str:
    """First line of a class's docstring."""
    return (inspect.getdoc(cls) or "").strip().splitlines()[0] if cls.__doc__ else ""


def sections(root: type) -> list[tuple[str, str]]:
    """[(name, one-line description)] of the fields of a root config: its sections and keys."""
    docs = field_docs(root)
    out = []
    for field in msgspec.structs.fields(root):
        doc = docs.get(field.name, "")
        out.append((field.encode_name, doc.splitlines()[0] if doc else ""))
    return out
