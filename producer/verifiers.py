"""Pluggable reward functions: `(response_text, answer) -> (reward, info)`.

Rewards are binary (1.0 correct, 0.0 otherwise); `info` is a small dict of
str/int/float/bool values that travels in the record's `reward_info`.

- `exact_match`: the response stripped of surrounding whitespace equals the
  answer (the tiny arithmetic task of common/toy/tasks.py).
- `math`: compares values, not strings. It takes the last `\\boxed{...}` if
  there is one, strips whitespace and `$`, and parses integers ("007",
  "1,000", "+5"), decimals ("0.5") and fractions ("3/6", "\\frac{1}{2}") to
  exact rationals, so "0.5" == "1/2" == "\\boxed{2/4}". Text that is not a
  number is compared as a whitespace-free string.

Select by name with `get_verifier(name)`; add one with `register_verifier`.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction

from common.errors import ConfigError

Verifier = Callable[[str, str], "tuple[float, dict]"]
_REGISTRY: dict[str, Verifier] = {}


def register_verifier(name: str, fn: Verifier) -> Verifier:
    """Make `fn` selectable as `get_verifier(name)` (e.g. from a plugin module)."""
    _REGISTRY[name] = fn
    return fn


def get_verifier(name: str) -> Verifier:
    """The verifier called `name`; ConfigError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown verifier {name!r}; choose one of {sorted(_REGISTRY)}",
                          key="producer.verifier") from None


def verifier_names() -> list[str]:
    return sorted(_REGISTRY)


# ---------------------------------------------------------------------------
# exact match
# ---------------------------------------------------------------------------
def exact_match(response: str, answer: str) -> tuple[float, dict]:
    got, want = response.strip(), answer.strip()
    ok = got == want
    return (1.0 if ok else 0.0), {"verifier": "exact_match", "parsed": got[:64], "correct": ok}


# ---------------------------------------------------------------------------
# math answers
# ---------------------------------------------------------------------------
_INT = r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)"
_NUM_RE = re.compile(rf"^({_INT})(?:\.(\d+))?$|^([+-]?)\.(\d+)$")
_FRAC_RE = re.compile(r"^([+-]?)\\d?frac\{([^{}]+)\}\{([^{}]+)\}$")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    i = start = starts[-1]
    depth = 1
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None  # unbalanced: treat as no boxed answer


def _strip(text: str) -> str:
    s = text.strip()
    for _ in range(3):  # "$ \boxed{5} $", "$$5$$", "\(5\)"
        s = s.strip().strip("$").strip()
        if s.startswith("\\(") and s.endswith("\\)"):
            s = s[2:-2]
        if s.startswith("\\[") and s.endswith("\\]"):
            s = s[2:-2]
    s = s.rstrip(".").strip()
    return s


def _number(s: str) -> Fraction | None:
    m = _NUM_RE.match(s)
    if m is None:
        return None
    if m.group(1) is not None:
        whole = m.group(1).replace(",", "")
        frac = m.group(2) or ""
        return Fraction(whole + ("." + frac if frac else ""))
    return Fraction(f"{m.group(3)}0.{m.group(4)}")


def parse_math(text: str) -> Fraction | str:
    """The exact rational a math answer denotes, or its normalised string form."""
    boxed = last_boxed(text)
    s = _strip(boxed if boxed is not None else text)
    s = s.replace(" ", "").replace("\\!", "").replace("{,}", ",")
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
    value = _number(s)
    if value is not None:
        return value
    parts = _fraction_parts(s)
    if parts is None:
        return s
    sign, num, den = parts
    if num is None or den is None or den == 0:
        return s
    return sign * num / den


def _fraction_parts(s: str) -> tuple[int, Fraction | None, Fraction | None] | None:
    """(sign, numerator, denominator) of "a/b", "-a/b" or "\\frac{a}{b}"; None if not a fraction."""
    m = _FRAC_RE.match(s)
    if m:
        return (-1 if m.group(1) == "-" else 1), _number(m.group(2)), _number(m.group(3))
    if s.count("/") != 1:
        return None
    a, b = s.split("/")
    sign = 1
    if a[:1] in ("+", "-"):
        sign, a = (-1 if a[0] == "-" else 1), a[1:]
    if a[:1] in ("+", "-"):  # "--1/2" is not a number
        return None
    return sign, _number(a), _number(b)


def math_verify(response: str, answer: str) -> tuple[float, dict]:
    got, want = parse_math(response), parse_math(answer)
    ok = got == want
    return (1.0 if ok else 0.0), {"verifier": "math", "parsed": str(got)[:64], "correct": ok}


register_verifier("exact_match", exact_match)
register_verifier("math", math_verify)
