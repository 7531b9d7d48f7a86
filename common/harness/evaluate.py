"""Held-out accuracy of a model directory: greedy decoding, exact match.

    from common.harness.evaluate import evaluate_dir
    r = evaluate_dir("runs/tiny-model", "runs/data/heldout.jsonl")
    print(r.accuracy, r.n, r.seconds)

    python -m common.harness.evaluate MODEL_DIR HELDOUT.jsonl [--pass-at 8]

The model is loaded with HF transformers (fp32, CPU), prompts are grouped by
token length so every batch is unpadded (the arithmetic prompts come in a few
lengths), and decoding is greedy with a KV cache until `<eos>` or
`max_new_tokens`. A response is correct when the task's verifier says so
(`common.toy.tasks` when it offers one, else exact match of the stripped text).

Used by the SFT warm start (common/harness/sft.py), by the demo to track each weight
version (common/harness/demo.py), and by the end-to-end test. `pass_at_k` samples k
responses per prompt at a temperature: what RL can exploit is the gap between
pass@k and greedy accuracy.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

log = logging.getLogger("rlstream.evaluate")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


@dataclass
class EvalResult:
    accuracy: float
    correct: int
    n: int
    seconds: float
    examples: list[dict]  # a few (prompt, answer, response) for the report

    def as_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------- data + verifier

def load_problems(path: str | os.PathLike, limit: int | None = None) -> list[Problem]:
    """JSONL rows with `prompt` and `answer` (the task files of common/toy/tasks.py)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out.append(Problem(str(row["prompt"]), str(row["answer"])))
                if limit is not None and len(out) >= limit:
                    break
    return out


def exact_match(response: str, answer: str) -> bool:
    return response.strip() == answer.strip()


def task_verifier() -> Callable[[str, str], bool]:
    """The arithmetic task's own check when common/toy/tasks.py offers one, else exact match."""
    try:
        from common.toy import tasks
    except ImportError:
        return exact_match
    for name in ("is_correct", "verify", "score"):
        fn = getattr(tasks, name, None)
        if callable(fn):
            return lambda response, answer, fn=fn: _truthy(fn(response, answer))
    return exact_match


def _truthy(v) -> bool:
    if isinstance(v, tuple):  # (reward, info)
        v = v[0]
    return float(v) > 0.5


# ----------------------------------------------------------------- model

def load_model(model_dir: str | os.PathLike):
    """(model, tokenizer) in fp32 eval mode on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model, tok


def _by_length(token_lists: list[list[int]]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(token_lists):
        groups[len(ids)].append(i)
    return groups


def _decode_loop(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
                 temperature: float, generator) -> list[list[int]]:
    """Decode one equal-length batch with a KV cache; greedy when temperature == 0."""
    import torch

    x = torch.tensor(prompts, dtype=torch.long)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]
    past = None
    for _ in range(max_new_tokens):
        res = model(input_ids=x, past_key_values=past, use_cache=True)
        past = res.past_key_values
        logits = res.logits[:, -1, :].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                if t == eos_id:
                    done[i] = True
                else:
                    out[i].append(t)
        if bool(done.all()):
            break
        x = nxt[:, None]
    return out


def generate(model, tok, prompts: list[str], max_new_tokens: int = 8, batch_size: int = 256,
             temperature: float = 0.0, seed: int = 0) -> list[str]:
    """Responses (text, without `<eos>`) for `prompts`; greedy unless temperature > 0."""
    import torch

    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    responses: list[str] = [""] * len(prompts)
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for _, idx in sorted(_by_length(ids).items()):
            for s in range(0, len(idx), batch_size):
                chunk = idx[s:s + batch_size]
                outs = _decode_loop(model, [ids[i] for i in chunk], max_new_tokens,
                                    tok.eos_token_id, temperature, gen)
                for i, o in zip(chunk, outs):
                    responses[i] = tok.decode(o, skip_special_tokens=True)
    return responses


def evaluate_model(model, tok, problems: list[Problem], max_new_tokens: int = 8,
                   batch_size: int = 256, n_examples: int = 6) -> EvalResult:
    t0 = time.perf_counter()
    check = task_verifier()
    responses = generate(model, tok, [p.prompt for p in problems], max_new_tokens, batch_size)
    hits = [check(r, p.answer) for r, p in zip(responses, problems)]
    examples = [{"prompt": p.prompt, "answer": p.answer, "response": r, "correct": h}
                for p, r, h in list(zip(problems, responses, hits))[:n_examples]]
    n = len(problems)
    return EvalResult(sum(hits) / max(n, 1), sum(hits), n, time.perf_counter() - t0, examples)


def evaluate_dir(model_dir: str | os.PathLike, heldout: str | os.PathLike | Iterable[Problem],
                 limit: int | None = None, max_new_tokens: int = 8, batch_size: int = 256) -> EvalResult:
    """Greedy held-out accuracy of the HF model in `model_dir`."""
    problems = load_problems(heldout, limit) if isinstance(heldout, (str, os.PathLike)) else list(heldout)[:limit]
    model, tok = load_model(model_dir)
    return evaluate_model(model, tok, problems, max_new_tokens, batch_size)


def pass_at_k(model, tok, problems: list[Problem], k: int = 8, temperature: float = 1.0,
              max_new_tokens: int = 8, seed: int = 0) -> dict:
    """Sampled accuracy: mean per-sample accuracy (pass@1) and pass@k at `temperature`."""
    check = task_verifier()
    prompts = [p.prompt for p in problems for _ in range(k)]
    responses = generate(model, tok, prompts, max_new_tokens, temperature=temperature, seed=seed)
    hits = [check(r, problems[i // k].answer) for i, r in enumerate(responses)]
    per_prompt = [hits[i * k:(i + 1) * k] for i in range(len(problems))]
    return {"k": k, "temperature": temperature,
            "sample_accuracy": sum(hits) / max(len(hits), 1),
            f"pass_at_{k}": sum(any(h) for h in per_prompt) / max(len(problems), 1)}


def heldout_scores(model, tok, problems: list[Problem], metric: str = "avg@8", temperature: float = 1.0,
                   max_new_tokens: int = 8, seed: int = 0) -> dict:
    """Greedy accuracy and, for metric "avg@k", mean sampled accuracy and pass@k.

    Returns {"metric": metric, "accuracy": <the metric's value>, "greedy": ..., "avg": ..., "pass": ...}.
    "avg@k" is the paper's evaluation (mean accuracy over k samples per problem
    at the rollout temperature); "greedy" is exact match of the greedy answer.
    """
    t0 = time.perf_counter()
    out = {"metric": metric, "greedy": evaluate_model(model, tok, problems, max_new_tokens).accuracy}
    if metric == "greedy":
        out["accuracy"] = out["greedy"]
    elif metric.startswith("avg@") and metric[4:].isdigit():
        k = int(metric[4:])
        pk = pass_at_k(model, tok, problems, k=k, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        out.update(accuracy=pk["sample_accuracy"], avg=pk["sample_accuracy"], **{"pass": pk[f"pass_at_{k}"]})
    else:
        raise ValueError(f"unknown held-out metric {metric!r}: use 'greedy' or 'avg@K'")
    out["seconds"] = time.perf_counter() - t0
    return out


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
    problems = load_problems(a.heldout, a.limit)
    model, tok = load_model(a.model_dir)
    r = evaluate_model(model, tok, problems, a.max_new_tokens)
    out = {"accuracy": r.accuracy, "n": r.n, "seconds": round(r.seconds, 2)}
    if a.pass_at:
        out.update(pass_at_k(model, tok, problems, k=a.pass_at, max_new_tokens=a.max_new_tokens))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
