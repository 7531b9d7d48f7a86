"""Verifiers: binary rewards, selection by name, math answers judged by math-verify.

`math` is math-verify 0.9.0 (real, in its worker process: common/tasks/mathjudge.py).
The cases below were written for the hand-written normaliser it replaced; the
five on which math-verify judges differently were decided one by one
(docs/producer.md "Verifiers"): `+5` and `\\dfrac{1}{4}` still equal 5 and 0.25
(a response math-verify extracts nothing from is read as bare LaTeX);
`\\boxed{x + 1}` still equals `x+1` (the gold is read as LaTeX);
`\\boxed{1} then \\boxed{2}` is now NOT 2 (two different boxed answers are a
hedge, not an answer) and `--1/2` now IS 1/2 (it is, mathematically).
"""
import threading
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlstream.common.errors import ConfigError
from rlstream.common.tasks import mathjudge
from rlstream.common.tasks.verifiers import get_verifier, register_verifier, verifier_names

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
    ("the answer is \\boxed{12}", "12"), ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("  $42$ ", "42"), ("$\\boxed{10}$", "10"), ("42.", "42"), ("4/1", "4"), ("12.50", "12.5"),
    ("--1/2", "1/2"),  # math-verify: double negation (the old normaliser refused it)
    ("\\boxed{x + 1}", "x+1"), ("a \\boxed{\\frac{1}{2}} b", "1/2"),
])
def test_math_equivalent(response, answer):
    reward, info = math(response, answer)
    assert reward == 1.0, info


@pytest.mark.parametrize("response,answer", [
    ("6", "7"), ("1/3", "0.33"), ("1,00", "100"), ("1/0", "0"), ("", "0"),
    ("\\boxed{2} then \\boxed{1}", "2"), ("12,5", "125"), ("x", "y"), ("0.5", "-1/2"),
    ("\\boxed{1} then \\boxed{2}", "2"),  # math-verify: two different boxed answers are no answer
])
def test_math_different(response, answer):
    assert math(response, answer)[0] == 0.0


def test_math_reads_answers_out_of_text_and_expressions():
    assert math("The answer is 7.", "7")[0] == 1.0
    assert math("$x = 7$", "7")[0] == 1.0
    assert math("\\boxed{x + 1}", "x+1")[1]["parsed"] == "x + 1"
    assert math("\\boxed{2x+2}", "2(x+1)")[0] == 1.0
    assert math("no answer here", "7")[0] == 0.0


@settings(deadline=None)
@given(st.integers(-10**9, 10**9))
def test_math_integer_formats(n):
    for text in (str(n), f"{n:,}", f"\\boxed{{{n}}}", f"${n}$", f" {n} "):
        assert math(text, str(n))[0] == 1.0, text
    if n >= 0:
        assert math("+" + str(n), str(n))[0] == 1.0
        assert math("00" + str(n), str(n))[0] == 1.0
    assert math(str(n + 1), str(n))[0] == 0.0


@settings(deadline=None)
@given(st.integers(-1000, 1000), st.integers(1, 1000), st.integers(1, 50))
def test_math_fractions_are_values(a, b, k):
    value = Fraction(a, b)
    assert math(f"{a}/{b}", str(value))[0] == 1.0
    assert math(f"{a * k}/{b * k}", f"{a}/{b}")[0] == 1.0
    assert math(f"\\frac{{{a * k}}}{{{b * k}}}", f"{a}/{b}")[0] == 1.0
    assert math(f"{a + b}/{b}", f"{a}/{b}")[0] == 0.0


@settings(deadline=None)
@given(st.integers(-10**6, 10**6), st.integers(0, 6))
def test_math_decimals_equal_their_fractions(m, e):
    dec = f"{m / 10**e:.{e}f}" if e else str(m)
    value = Fraction(m, 10**e)
    assert math(dec, f"{m}/{10**e}")[0] == 1.0
    assert math(dec, str(value))[0] == 1.0


def test_rewards_are_binary_floats_and_info_is_flat():
    for fn in (math, exact):
        for r, a in (("1", "1"), ("1", "2"), ("junk", "3")):
            reward, info = fn(r, a)
            assert isinstance(reward, float) and reward in (0.0, 1.0)
            assert all(isinstance(v, (str, int, float, bool)) for v in info.values())


def test_math_runs_from_any_thread_and_leaves_the_alarm_alone():
    """math-verify's own signal.alarm timeouts run in the worker: a caller's
    thread works, and the caller's SIGALRM timer (pytest-timeout's) survives."""
    import signal

    out = []
    t = threading.Thread(target=lambda: out.append(math("\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join(60)
    assert out and out[0][0] == 1.0
    old = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        math("\\boxed{\\frac{1}{2}}", "0.5")
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert left > 25.0, "the verifier cancelled this process's alarm"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_pathological_answer_scores_zero_in_bounded_time():
    t0 = time.monotonic()
    reward, info = math("\\boxed{9^{9^{9}}}", "1")  # unbounded without a timeout
    assert reward == 0.0 and time.monotonic() - t0 < mathjudge.CALL_TIMEOUT_S


def test_a_stuck_worker_is_replaced_and_the_answer_scores_zero(monkeypatch):
    judge = mathjudge.MathJudge()
    try:
        assert judge("7", "7") == (True, "7")
        monkeypatch.setattr(mathjudge, "CALL_TIMEOUT_S", 0.0)  # every answer is now too late
        assert judge("7", "7") == (False, "<timeout>") and judge.replaced == 1
        monkeypatch.undo()
        assert judge("7", "7") == (True, "7"), "the next call gets a fresh worker"
    finally:
        judge.close()


def test_a_worker_that_cannot_start_is_a_verifier_error(monkeypatch):
    from rlstream.common.errors import VerifierError

    judge = mathjudge.MathJudge()
    monkeypatch.setattr(mathjudge.sys, "executable", "/bin/false")
    with pytest.raises(VerifierError, match="did not start"):
        judge("7", "7")
