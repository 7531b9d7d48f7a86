"""Held-out accuracy of a model directory: greedy decoding, exact match.

    from rlstream.harness.evaluate import evaluate_dir
    r = evaluate_dir("runs/tiny-model", "runs/data/heldout.jsonl")
    print(r.accuracy, r.n, r.seconds)

    python -m rlstream.harness.evaluate MODEL_DIR HELDOUT.jsonl [--pass-at 8]

The model is loaded with HF transformers (fp32, CPU), prompts are grouped by
token length so every batch is unpadded (the arithmetic prompts come in a few
lengths), and decoding is greedy with a KV cache until `<eos>` or
`max_new_tokens`. Problems, their file format and the check (exact match of
the stripped text) are the task's own: `rlstream.common.tasks.arithmetic.Problem`,
`read_problems`, `is_correct`.

Used by the SFT warm start (ops/harness/sft.py), by the demo (the warm
start's score, and `VersionEvaluator` for each new weight version during a
run), and by the end-to-end test. `pass_at_k` samples k responses per prompt
at a temperature: what RL can exploit is the gap between pass@k and greedy
accuracy; `heldout_scores` reports the demo's metric (`DEFAULT_METRIC`) beside
greedy accuracy.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from rlstream.common.errors import ConfigError
from rlstream.common.tasks.arithmetic import Problem, is_correct, read_problems
from rlstream.common.weights.store import WeightStore
from rlstream.harness.hf_decode import by_length, decode_loop, load_model
from rlstream.harness.tool_eval import tool_scores
from rlstream.producer.text_tokens import encode_text

log = logging.getLogger("rlstream.evaluate")

# Held-out accuracy the demo tracks: mean accuracy over 8 samples per problem at
# the rollout temperature (the paper's "mean accuracy over k samples"); greedy
# accuracy is reported beside it.
DEFAULT_METRIC = "avg@8"


@dataclass
class EvalResult:
    accuracy: float
    correct: int
    n: int
    seconds: float
    examples: list[dict]  # a few (prompt, answer, response) for the report

    def as_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------- model

def generate_text(model, tok, prompts: list[str], max_new_tokens: int = 8, batch_size: int = 256,
             temperature: float = 0.0, seed: int = 0) -> list[str]:
    """Responses (text, without `<eos>`) for `prompts`; greedy unless temperature > 0. A prompt is
    tokenised as the producer's engine does: a special token's text in it stays text
    (producer/text_tokens.py)."""
    import torch

    ids = [encode_text(tok, p) for p in prompts]
    responses: list[str] = [""] * len(prompts)
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for _, idx in sorted(by_length(ids).items()):
            for s in range(0, len(idx), batch_size):
                chunk = idx[s:s + batch_size]
                outs = decode_loop(model, [ids[i] for i in chunk], max_new_tokens,
                                    tok.eos_token_id, temperature, gen)
                for i, o in zip(chunk, outs):
                    responses[i] = tok.decode(o, skip_special_tokens=True)
    return responses


def evaluate_model(model, tok, problems: list[Problem], max_new_tokens: int = 8,
                   batch_size: int = 256, n_examples: int = 6) -> EvalResult:
    t0 = time.perf_counter()
    responses = generate_text(model, tok, [p.prompt for p in problems], max_new_tokens, batch_size)
    hits = [is_correct(r, p.answer) for r, p in zip(responses, problems)]
    examples = [{"prompt": p.prompt, "answer": p.answer, "response": r, "correct": h}
                for p, r, h in list(zip(problems, responses, hits))[:n_examples]]
    n = len(problems)
    return EvalResult(sum(hits) / max(n, 1), sum(hits), n, time.perf_counter() - t0, examples)


def evaluate_dir(model_dir: str | os.PathLike, heldout: str | os.PathLike | Iterable[Problem],
                 limit: int | None = None, max_new_tokens: int = 8, batch_size: int = 256) -> EvalResult:
    """Greedy held-out accuracy of the HF model in `model_dir`."""
    problems = read_problems(heldout, limit) if isinstance(heldout, (str, os.PathLike)) else list(heldout)[:limit]
    model, tok = load_model(model_dir)
    return evaluate_model(model, tok, problems, max_new_tokens, batch_size)


def pass_at_k(model, tok, problems: list[Problem], k: int = 8, temperature: float = 1.0,
              max_new_tokens: int = 8, seed: int = 0) -> dict:
    """Sampled accuracy: mean per-sample accuracy (pass@1) and pass@k at `temperature`."""
    prompts = [p.prompt for p in problems for _ in range(k)]
    responses = generate_text(model, tok, prompts, max_new_tokens, temperature=temperature, seed=seed)
    hits = [is_correct(r, problems[i // k].answer) for i, r in enumerate(responses)]
    per_prompt = [hits[i * k:(i + 1) * k] for i in range(len(problems))]
    return {"k": k, "temperature": temperature,
            "sample_accuracy": sum(hits) / max(len(hits), 1),
            f"pass_at_{k}": sum(any(h) for h in per_prompt) / max(len(problems), 1)}


def heldout_scores(model, tok, problems: list[Problem], metric: str = DEFAULT_METRIC, temperature: float = 1.0,
                   max_new_tokens: int = 8, seed: int = 0, episodes=None) -> dict:
    """Greedy accuracy and, for metric "avg@k", mean sampled accuracy and pass@k.

    Returns {"metric": metric, "accuracy": <the metric's value>, "greedy": ..., "avg": ..., "pass": ...}.
    "avg@k" is the paper's evaluation (mean accuracy over k samples per problem
    at the rollout temperature); "greedy" is exact match of the greedy answer.
    With `episodes` (`producer.episodes` settings) every score is WITH the tool
    (ops/harness/tool_eval.py `tool_scores`: also call_rate, calls_per_episode,
    ends) and "no_tool" is the single-turn greedy accuracy on the same prompts.
    """
    t0 = time.perf_counter()
    if episodes is not None:
        out = tool_scores(model, tok, problems, episodes, metric, temperature, seed)
        out["no_tool"] = evaluate_model(model, tok, problems, max_new_tokens).accuracy
        if metric.startswith("avg@"):
            out["no_tool_avg"] = pass_at_k(model, tok, problems, int(metric[4:]), temperature, max_new_tokens,
                                           seed)["sample_accuracy"]
        out["seconds"] = time.perf_counter() - t0
        return out
    out = {"metric": metric, "greedy": evaluate_model(model, tok, problems, max_new_tokens).accuracy}
    if metric == "greedy":
        out["accuracy"] = out["greedy"]
    elif metric.startswith("avg@") and metric[4:].isdigit():
        k = int(metric[4:])
        pk = pass_at_k(model, tok, problems, k=k, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        out.update(accuracy=pk["sample_accuracy"], avg=pk["sample_accuracy"], **{"pass": pk[f"pass_at_{k}"]})
    else:
        raise ConfigError(f"unknown held-out metric {metric!r}: use 'greedy' or 'avg@K'", key="demo.eval_metric")
    out["seconds"] = time.perf_counter() - t0
    return out


class VersionEvaluator:
    """Held-out scores (`heldout_scores`: the run's metric and greedy) of the newest
    version in a weight store; versions pruned before they could be loaded are skipped."""

    def __init__(self, store_dir: Path, heldout: Path, metric: str = DEFAULT_METRIC,
                 temperature: float = 1.0, max_new_tokens: int = 8, limit: int | None = None,
                 episodes=None):
        self.store_dir = store_dir
        self.episodes = episodes
        """`producer.episodes` settings: score with the tool (`heldout_scores`); None: single-turn."""
        self.problems = read_problems(heldout, limit)
        self.metric, self.temperature, self.max_new_tokens = metric, temperature, max_new_tokens
        self.last_version = -1
        self.last_at = 0.0

    def due(self, min_interval_s: float) -> bool:
        return self.seconds_until_due(min_interval_s) <= 0.0

    def seconds_until_due(self, min_interval_s: float) -> float:
        """Seconds until the next evaluation is due (<= 0: now); the interval runs from the last one's start."""
        return self.last_at + min_interval_s - time.monotonic()

    def evaluate_newest(self) -> tuple[int, dict] | None:
        """(version, scores) of the newest version not evaluated yet, else None."""
        store = WeightStore(self.store_dir, keep=1 << 30)  # keep: never prunes, only reads
        versions = store.versions()
        if not versions or versions[-1] == self.last_version:
            return None
        v = versions[-1]
        try:
            model, tok = load_model(store.path(v))
        except Exception as e:  # noqa: BLE001 - pruned while loading: try the next one later
            log.info("version %d vanished while loading (%s); skipping", v, e)
            return None
        self.last_version, self.last_at = v, time.monotonic()
        return v, heldout_scores(model, tok, self.problems, self.metric, self.temperature, self.max_new_tokens,
                                 episodes=self.episodes)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("heldout")
    p.add_argument("--limit", type=int)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--pass-at", type=int, default=0, help="also report pass@k at temperature 1")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    problems = read_problems(a.heldout, a.limit)
    model, tok = load_model(a.model_dir)
    r = evaluate_model(model, tok, problems, a.max_new_tokens)
    out = {"accuracy": r.accuracy, "n": r.n, "seconds": round(r.seconds, 2)}
    if a.pass_at:
        out.update(pass_at_k(model, tok, problems, k=a.pass_at, max_new_tokens=a.max_new_tokens))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
