"""A small black-box agent: the calculator tool loop, driven through the producer's
OpenAI-compatible agent endpoint with the official `openai` client (docs/multi-turn.md).

    python -m tests.support.calc_agent --url http://127.0.0.1:PORT --token T --groups 2 --out calls.jsonl

For each group (POST /v1/groups: the producer hands out the next arithmetic prompt and
G episodes), each episode runs:

    reply = chat(messages)                  # the model's turn
    reply ends with a call c(expr)  -> tool message "=<value>,"  (the calculator)
    not a call, fewer than --min-tool-turns tool messages so far -> tool message "=err,"
    otherwise: the final answer      -> POST reward (1 if it is the task's value, else 0)

The first episode of every group sends no reward and lets the producer's verifier
score it. `--abandon K` leaves the last K episodes of the last group after their first
call (the producer ends them as `abandoned`). `--check-refusals` first tries calls the
endpoint must refuse (wrong token 401, a rewritten assistant message 409, another
temperature 400). Every answer's `rlstream` block and every reward answer is written
to --out as one JSON line.
"""
from __future__ import annotations

import argparse
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from rlstream.common.tasks.envs.calculator import calculate

CALL = re.compile(r"c\(([0-9+\-*/ ]{1,32})\)$")


def post(url: str, token: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    return r.status_code, r.json()


def run_episode(base_url: str, token: str, prompt: str, args, log, verify: bool, abandon: bool) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": prompt}]
    tool_turns = 0
    while True:
        r = client.chat.completions.create(model="rlstream", messages=messages, max_tokens=args.max_tokens,
                                           stop=[")"], logprobs=True, temperature=1.0)
        text = r.choices[0].message.content
        extra = r.model_extra["rlstream"]
        log({"kind": "call", "text": text, "logprobs_openai": [c.logprob for c in r.choices[0].logprobs.content],
             **extra})
        if abandon:
            return
        messages.append({"role": "assistant", "content": text})
        if sum(m["role"] == "assistant" for m in messages) >= args.max_turns:
            break  # producer.episodes.max_turns: a further call would be refused
        call = CALL.search(text)
        if call and r.choices[0].finish_reason == "stop":
            messages.append({"role": "tool", "content": f"={calculate(call.group(1))},"})
        elif tool_turns < args.min_tool_turns:
            messages.append({"role": "tool", "content": "=err,"})
        else:
            break
        tool_turns += 1
    body = {} if verify else {"reward": float(text.strip() == calculate(prompt.rstrip("="))),
                              "info": {"agent": "calc_agent"}}
    status, answer = post(f"{base_url}/reward", token, body)
    log({"kind": "reward", "status": status, **answer})


def check_refusals(url: str, token: str, log) -> None:
    status, group = post(f"{url}/v1/groups", "wrong", {})
    log({"kind": "refusal", "case": "token", "status": status})
    status, group = post(f"{url}/v1/groups", token, {"prompt": "1+2=", "answer": "3"})
    for ep in group["episodes"][1:]:  # closed before their first call: nothing is published for them
        post(f"{ep['base_url']}/reward", token, {"reward": 0.0})
    base = group["episodes"][0]["base_url"]
    first = [{"role": "user", "content": "1+2="}]
    status, r = post(f"{base}/chat/completions", token, {"messages": first, "max_tokens": 3})
    turn = r["choices"][0]["message"]["content"]
    rewritten = first + [{"role": "assistant", "content": turn + "x"}, {"role": "tool", "content": "=3,"}]
    status, r = post(f"{base}/chat/completions", token, {"messages": rewritten, "max_tokens": 3})
    log({"kind": "refusal", "case": "history", "status": status, "type": r["error"]["type"]})
    ok = first + [{"role": "assistant", "content": turn}, {"role": "tool", "content": "=3,"}]
    status, r = post(f"{base}/chat/completions", token, {"messages": ok, "max_tokens": 3, "temperature": 0.5})
    log({"kind": "refusal", "case": "temperature", "status": status})
    status, r = post(f"{base}/reward", token, {"reward": 0.0})
    log({"kind": "refusal", "case": "closed", "status": status, "published": r["published"]})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--min-tool-turns", type=int, default=1)
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--abandon", type=int, default=0)
    ap.add_argument("--check-refusals", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    lock = threading.Lock()
    with open(args.out, "w") as f:
        def log(obj):
            with lock:
                f.write(json.dumps(obj) + "\n")
                f.flush()

        if args.check_refusals:
            check_refusals(args.url, args.token, log)
        for g in range(args.groups):
            status, group = post(f"{args.url}/v1/groups", args.token, {})
            assert status == 200, group
            log({"kind": "group", **group})
            eps = group["episodes"]
            with ThreadPoolExecutor(len(eps)) as pool:  # a group's episodes at once: the engine batches them
                futures = [pool.submit(run_episode, ep["base_url"], args.token, group["prompt"], args, log,
                                       i == 0, g == args.groups - 1 and i >= len(eps) - args.abandon)
                           for i, ep in enumerate(eps)]
                for fut in futures:
                    fut.result()


if __name__ == "__main__":
    main()
