"""The tool-use environment's tools: a calculator and a small key-value store (MCP server).

verifiers starts one such server per rollout (`python -m primerl_tool_use.tools`), so the
key-value store is private to its rollout.
"""

from __future__ import annotations

from fractions import Fraction

import verifiers.v1 as vf

MAX_KEYS = 64


def _number(x) -> Fraction:
    try:
        return Fraction(str(x))
    except (ValueError, ZeroDivisionError) as e:
        raise ValueError(f"not a number: {x!r}") from e


def _show(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else str(x)


class Tools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "tools"

    def __init__(self, config: vf.ToolsetConfig) -> None:
        super().__init__(config)
        self.store: dict[str, str] = {}

    @vf.tool
    def add(self, a: str, b: str) -> str:
        """a + b, exactly."""
        return _show(_number(a) + _number(b))

    @vf.tool
    def mul(self, a: str, b: str) -> str:
        """a * b, exactly."""
        return _show(_number(a) * _number(b))

    @vf.tool
    def set(self, key: str, value: str) -> str:
        """Store value under key."""
        if key not in self.store and len(self.store) >= MAX_KEYS:
            return f"error: the store is full ({MAX_KEYS} keys)"
        self.store[key] = value
        return "ok"

    @vf.tool
    def get(self, key: str) -> str:
        """The value stored under key."""
        return self.store.get(key, f"error: no key {key!r}")


if __name__ == "__main__":
    Tools.run()
