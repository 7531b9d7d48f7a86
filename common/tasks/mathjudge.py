"""math-verify, run where its timeouts can hurt nobody: one persistent worker process.

    judge = MathJudge()
    correct, parsed = judge("The answer is \\boxed{\\frac{1}{2}}", "0.5")   # (True, "1/2")

math-verify 0.9.0 bounds `parse` and `verify` with `signal.alarm`. In any
thread but the main one that raises ValueError (even with raise_on_error
False); in the main thread it cancels every other SIGALRM timer of the process
(pytest-timeout's among them); and without a timeout a 16-character answer
such as `\\boxed{9^{9^{9}}}` keeps `verify` busy for minutes. So no rlstream
process calls it directly: every call goes to a worker process
(`python -m rlstream.common.tasks.mathjudge`), whose main thread runs math-verify with its
own 1 s alarms (`MV_TIMEOUT_S`: whole seconds, a fraction makes every call
fail silently), and the caller waits at most `CALL_TIMEOUT_S` for the answer. A
worker that does not answer in time (stuck in C code) is killed and replaced,
and that answer scores 0; one that cannot start at all is a VerifierError. Any
thread may call; calls are serialised.

How an answer is read (docs/producer.md lists where this differs from the
normaliser it replaced): the gold answer is parsed as LaTeX (wrapped in `$...$`
unless it has delimiters: a bare `x+1` is not extracted otherwise); the
response's last `MAX_RESPONSE_CHARS` characters go through math-verify's
extractor (boxed answers, "the answer is 7", `$x = 7$`), and, when it extracts
nothing, the same text is read as bare LaTeX (`+5`, `\\dfrac{1}{4}`).

Protocol: JSON lines on the worker's stdin/stdout; the worker says
`{"ready": true}` once math-verify is imported (~1.5-2.5 s) and exits at EOF,
so it never outlives the producer. Its stderr is the producer's.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

from rlstream.common import metrics
from rlstream.common.errors import VerifierError

log = logging.getLogger("rlstream.producer")
_TIMEOUTS = metrics.counter("rlstream_producer_verifier_timeouts_total",
                            "math-verify answers that took over CALL_TIMEOUT_S (scored 0, worker replaced)")

MV_TIMEOUT_S = 1
"""math-verify's own per-parse and per-comparison timeout inside the worker (an int)."""
CALL_TIMEOUT_S = 10.0
"""Longest wait for one answer; past it the worker is replaced and the answer scores 0."""
STARTUP_TIMEOUT_S = 120.0
"""Longest wait for a new worker to import math-verify."""
MAX_RESPONSE_CHARS = 2000
"""Only the end of a response is read: it holds the answer, and it bounds the work."""
_DELIMITERS = ("$", "\\boxed", "\\(", "\\[")


class MathJudge:
    """A client of one worker process, started at the first call."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self.replaced = 0
        """Workers killed because an answer took longer than CALL_TIMEOUT_S."""

    def __call__(self, response: str, answer: str) -> tuple[bool, str]:
        """(equivalent?, math-verify's reading of the response)."""
        with self._lock:
            self._ensure_started()
            self._send({"response": response[-MAX_RESPONSE_CHARS:], "answer": answer})
            reply = self._read(time.monotonic() + CALL_TIMEOUT_S)
            if reply is None:  # stuck: a fresh worker for the next call
                log.warning("math-verify took over %.0f s for an answer; replacing its worker", CALL_TIMEOUT_S)
                self.replaced += 1
                _TIMEOUTS.inc()
                self.close()
                return False, "<timeout>"
            return bool(reply.get("correct")), str(reply.get("parsed", ""))

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._proc = subprocess.Popen([sys.executable, "-m", "rlstream.common.tasks.mathjudge"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self._buf = b""
        if self._read(time.monotonic() + STARTUP_TIMEOUT_S) != {"ready": True}:
            self.close()
            raise VerifierError(f"the math-verify worker did not start within {STARTUP_TIMEOUT_S:.0f} s (its "
                                "error is in this log above); check `python -m rlstream.common.tasks.mathjudge` and that "
                                "math-verify[antlr4_13_2]==0.9.0 is installed")

    def _send(self, msg: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: _read sees EOF and the call scores 0

    def _read(self, deadline: float) -> dict | None:
        """The worker's next line as JSON; None at the deadline or if it died."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout):
                f.close()
            self._proc = None


# ---------------------------------------------------------------------------- the worker

def _gold_text(answer: str) -> str:
    a = answer.strip()
    return a if any(d in a for d in _DELIMITERS) else f"${a}$"


def judge(response: str, answer: str) -> tuple[bool, str]:
    """math-verify's verdict, in this process (the worker's main thread only)."""
    from math_verify import parse, verify

    gold = parse(_gold_text(answer), parsing_timeout=MV_TIMEOUT_S)
    pred = parse(response, parsing_timeout=MV_TIMEOUT_S)
    if not pred and response.strip() and not any(d in response for d in _DELIMITERS):
        pred = parse(f"${response.strip()}$", parsing_timeout=MV_TIMEOUT_S)  # bare LaTeX: "+5", "\dfrac{1}{4}"
    return bool(verify(gold, pred, timeout_seconds=MV_TIMEOUT_S)), (str(pred[-1]) if pred else "")


def serve(stdin=sys.stdin.buffer, stdout=sys.stdout.buffer) -> int:
    """The worker: one JSON request per line in, one reply per line out, until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the producer's to handle; EOF ends the worker
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # a timeout logs the whole input at WARNING
    from math_verify.errors import TimeoutException

    judge("1", "1")  # the slow part (importing sympy and the LaTeX parser, ~1-2.5 s), before saying ready
    stdout.write(b'{"ready": true}\n')
    stdout.flush()
    for line in stdin:
        req = json.loads(line)
        try:
            ok, parsed = judge(req["response"], req["answer"])
            reply = {"correct": ok, "parsed": parsed[:64]}
        except (Exception, TimeoutException) as e:  # noqa: BLE001 - a malformed answer scores 0
            reply = {"correct": False, "parsed": f"<{type(e).__name__}>"}
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
