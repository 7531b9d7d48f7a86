"""The calculator tool for the arithmetic task (common/tasks/arithmetic.py), in the tiny
tokenizer's characters:

    prompt          37+48-19=
    model turn 1    c(37+48)          a call ends with ')' (a stop token)
    observation 1   =85,
    model turn 2    c(85-19)
    observation 2   =66,
    model turn 3    66<eos>           no call: the final answer, scored by the task

A turn that is not a call (or ends for length) is the final answer: reward = the
task's score of its text; the episode is done. A malformed call gets the
observation "=err," (the model pays for it in turns). Expressions: integers with
+ - * / (floor division), at most 32 characters, evaluated without eval().
"""
from __future__ import annotations

import re

from rlstream.common.tasks.environment import ModelTurn, StepResult
from rlstream.common.tasks.task import Task

CALL = re.compile(r"c\(([0-9+\-*/ ]{1,32})\)$")


def calculate(expr: str) -> str:
    """The value of `expr` as text, or "err"; * and / before + and -."""
    toks = re.findall(r"\d+|[+\-*/]", expr.replace(" ", ""))
    if "".join(toks) != expr.replace(" ", "") or not toks:
        return "err"
    if toks[0] == "-" and len(toks) > 1 and toks[1].isdigit():
        toks = ["-" + toks[1]] + toks[2:]
    if not re.fullmatch(r"-?\d+", toks[0]) or len(toks) % 2 == 0:
        return "err"
    terms, ops = [int(toks[0])], []
    for op, num in zip(toks[1::2], toks[2::2]):
        if not num.isdigit():
            return "err"
        if op == "*":
            terms[-1] *= int(num)
        elif op == "/":
            if int(num) == 0:
                return "err"
            terms[-1] //= int(num)
        else:
            ops.append(op)
            terms.append(int(num))
    value = terms[0]
    for op, t in zip(ops, terms[1:]):
        value = value + t if op == "+" else value - t
    return str(value)


class CalculatorEnv:
    """One episode of the arithmetic task with the c(expr) tool."""

    stop_texts = (")",)
    resumable = True
    """Its state is rebuilt by replaying the model turns (producer/journal/resume.py)."""

    @staticmethod
    def reference_turns(prompt: str) -> list[tuple[str, bool]] | None:
        """A worked solution with the tool (module function `reference_turns`), for SFT."""
        return reference_turns(prompt)

    def reset(self, task: Task) -> str:
        self.task, self.calls = task, 0
        return task.prompt

    def step(self, turn: ModelTurn) -> StepResult:
        text = turn.text.strip()
        if turn.finish_reason == "stop" and text.startswith("c("):
            self.calls += 1
            m = CALL.search(text)
            return StepResult("=" + (calculate(m.group(1)) if m else "err") + ",")
        reward, info = self.task.score(text)
        return StepResult(None, float(reward), True, {**info, "tool_calls": self.calls})


def reference_turns(prompt: str) -> list[tuple[str, bool]] | None:
    """The worked solution of an arithmetic prompt ("a+b-c=") with the tool, as
    [(text, is_model_turn)] after the prompt: one call per operator, left to right,
    each followed by its observation, then the final answer (without EOS):

        37+48-19=  ->  [("c(37+48)", True), ("=85,", False), ("c(85-19)", True), ("=66,", False), ("66", True)]

    None if the prompt is not a chain of integers joined by + and -. The SFT warm
    start (ops/harness/sft.py) teaches the call format with these traces.
    """
    m = re.fullmatch(r"(\d+)((?:[+-]\d+)+)=", prompt.strip())
    if not m:
        return None
    value, turns = m.group(1), []
    for op, num in re.findall(r"([+-])(\d+)", m.group(2)):
        expr = f"{value}{op}{num}"
        value = calculate(expr)
        turns += [(f"c({expr})", True), (f"={value},", False)]
    return turns + [(value, True)]
