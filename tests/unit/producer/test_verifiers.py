"""Verifiers: binary rewards, selection by name, math normalisation."""
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.errors import ConfigError
from producer.verifiers import get_verifier, last_boxed, parse_math, register_verifier, verifier_names

math = get_verifier("math")
exact = get_verifier("exact_match")


def test_selection_by_name_and_unknown_name():
    assert {"exact_match", "math"} <= set(verifier_names())
    with pytest.raises(ConfigError, match="unknown verifier 'nope'.*exact_match"):
        get_verifier("nope")
    register_verifier("always", lambda r, a: (1.0, {}))
    assert get_verifier("always")("x", "y") == (1.0, {})


def test_exact_match():
    assert exact("19", "19")[0] == 1.0
    assert exact(" 19\n", "19")[0] == 1.0
    assert exact("19 ", " 19")[1]["correct"] is True
    assert exact("019", "19")[0] == 0.0
    assert exact("", "19")[0] == 0.0
    assert exact("1 9", "19")[0] == 0.0


@pytest.mark.parametrize("response,answer", [
    ("007", "7"), ("1,000", "1000"), ("+5", "5"), ("-0", "0"), ("1,234,567", "1234567"),
    ("3/6", "1/2"), ("0.5", "1/2"), (".5", "1/2"), ("2/4", "0.50"), ("-3/6", "-0.5"), ("1/-2", "-1/2"),
    ("\\frac{3}{6}", "1/2"), ("\\dfrac{1}{4}", "0.25"), ("-\\frac{1}{2}", "-0.5"),
    ("the answer is \\boxed{12}", "12"), ("\\boxed{1} then \\boxed{2}", "2"), ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("  $42$ ", "42"), ("$\\boxed{10}$", "10"), ("42.", "42"), ("4/1", "4"), ("12.50", "12.5"),
])
def test_math_equivalent(response, answer):
    reward, info = math(response, answer)
    assert reward == 1.0, info


@pytest.mark.parametrize("response,answer", [
    ("6", "7"), ("1/3", "0.33"), ("1,00", "100"), ("--1/2", "1/2"), ("1/0", "0"), ("", "0"),
    ("\\boxed{2} then \\boxed{1}", "2"), ("12,5", "125"), ("x", "y"), ("0.5", "-1/2"),
])
def test_math_different(response, answer):
    assert math(response, answer)[0] == 0.0


def test_math_non_numbers_compare_as_strings():
    assert math("\\boxed{x + 1}", "x+1")[0] == 1.0
    assert parse_math("abc") == "abc"


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} \\boxed{{2}}") == "{2}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{unclosed") is None


@given(st.integers(-10**9, 10**9))
def test_math_integer_formats(n):
    for text in (str(n), f"{n:,}", f"\\boxed{{{n}}}", f"${n}$", f" {n} "):
        assert math(text, str(n))[0] == 1.0, text
    if n >= 0:
        assert math("+" + str(n), str(n))[0] == 1.0
        assert math("00" + str(n), str(n))[0] == 1.0
    assert math(str(n + 1), str(n))[0] == 0.0


@given(st.integers(-1000, 1000), st.integers(1, 1000), st.integers(1, 50))
def test_math_fractions_are_values(a, b, k):
    value = Fraction(a, b)
    assert parse_math(f"{a}/{b}") == value
    assert math(f"{a * k}/{b * k}", f"{a}/{b}")[0] == 1.0
    assert math(f"\\frac{{{a * k}}}{{{b * k}}}", f"{a}/{b}")[0] == 1.0
    assert math(f"{a + b}/{b}", f"{a}/{b}")[0] == 0.0


@given(st.integers(-10**6, 10**6), st.integers(0, 6))
def test_math_decimals_equal_their_fractions(m, e):
    dec = f"{m / 10**e:.{e}f}" if e else str(m)
    assert parse_math(dec) == Fraction(m, 10**e)
    assert math(dec, f"{m}/{10**e}")[0] == 1.0


def test_rewards_are_binary_floats_and_info_is_flat():
    for fn in (math, exact):
        for r, a in (("1", "1"), ("1", "2"), ("junk", "3")):
            reward, info = fn(r, a)
            assert isinstance(reward, float) and reward in (0.0, 1.0)
            assert all(isinstance(v, (str, int, float, bool)) for v in info.values())
