"""Reward helpers shared by the built-in environments (pure functions, unit-tested by hand)."""

from __future__ import annotations

import re
from fractions import Fraction


def lcs_length(a, b) -> int:
    """Length of the longest common subsequence of two sequences (O(len(a) * len(b)))."""
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def lcs_ratio(prediction, target) -> float:
    """2 * LCS / (len(prediction) + len(target)): 1.0 for equal sequences, 0.0 for disjoint."""
    total = len(prediction) + len(target)
    return 1.0 if total == 0 else 2.0 * lcs_length(prediction, target) / total


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(/\d+)?$")


def parse_number(text: str) -> Fraction | None:
    """An exact number from `12`, `-3.5`, `7/2`, `1,000` (commas as thousands separators)."""
    text = text.replace(",", "").replace(" ", "")
    if not _NUMBER.match(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def boxed_answer_matches(reply: str, answer: str) -> bool:
    """Whether the last boxed answer in `reply` equals `answer` (numerically when both are
    numbers, else as text after trimming)."""
    boxed = last_boxed(reply or "")
    if boxed is None:
        return False
    got, want = parse_number(boxed), parse_number(answer)
    if got is not None and want is not None:
        return got == want
    return boxed == answer.strip()
