"""Supervised warm start ("cold start" in the paper) of the tiny MoE model.

    from rlstream.harness.sft import SftConfig, warm_start
    res = warm_start("runs/tiny-model", "runs/demo/warm-model", "train.jsonl", "heldout.jsonl")

    python -m rlstream.harness.sft BASE_DIR OUT_DIR TRAIN.jsonl HELDOUT.jsonl [--low 0.15 --high 0.45]

RL only improves a policy that already solves some problems: with binary
rewards a group whose G samples are all wrong has zero advantage everywhere.
So the demo first fine-tunes the random tiny model on the arithmetic task's
train split, and stops on purpose while it still fails most held-out problems
(accuracy inside a band, default 0.15-0.45), leaving RL room to show a gain.

Training: plain torch loop, fp32, CPU, AdamW with a short linear warm-up, on
"prompt + answer + <eos>" with the loss on the answer and `<eos>` tokens only
(prompt positions are masked). Every `eval_every` steps the held-out accuracy
(greedy, ops/harness/evaluate.py) is measured; training stops at the first
evaluation inside the band, or at `max_steps`. If one evaluation interval jumps
over the band, the evaluated snapshot closest to it is kept. The result is
saved HF-format (`save_pretrained`, safetensors) with the tokenizer, so vLLM
and the Megatron converter load it as they load the base model, plus
`rlstream_sft.json` (settings, data digest, accuracy, time) which lets the
demo reuse a warm model built from the same inputs.

Tool format (`ToolSft`, the tool_use experiment): a share of the training
problems is written as an episode of the environment instead, its worked
solution (`reference_turns` of the environment class, e.g. the calculator's
"c(37+48)" "=85," ... "66"): the loss is on the model turns and `<eos>`, not
on the prompt or the observations, exactly the tokens the producer would
sample. The rest stay plain answers, so the model can still answer without the
tool and RL decides between the two. The band is then measured WITH the tool
(greedy episodes, ops/harness/tool_eval.py), and the warm model this starts
from is usually the plain warm start (`prepare_warm`), so the format is all
this stage has to teach.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlstream.common.config import EpisodeSettings
from rlstream.common.errors import ConfigError
from rlstream.common.tasks.arithmetic import Problem, read_problems
from rlstream.common.tasks.envs import env_factory
from rlstream.harness.evaluate import evaluate_model
from rlstream.harness.hf_decode import load_model
from rlstream.harness.tool_eval import run_episodes
from rlstream.producer.text_tokens import encode_text

log = logging.getLogger("rlstream.sft")

SFT_MARKER = "rlstream_sft.json"


@dataclass(frozen=True)
class SftConfig:
    band_low: float = 0.15
    """Stop at the first evaluation with held-out accuracy >= band_low ..."""
    band_high: float = 0.45
    """... and <= band_high (a minority: RL must have room to improve)."""
    lr: float = 2e-3
    warmup_steps: int = 50
    batch_size: int = 64
    max_steps: int = 4000
    eval_every: int = 50
    eval_limit: int | None = None
    """Held-out problems per periodic evaluation (None: all)."""
    max_new_tokens: int = 8
    num_threads: int = 2
    """torch threads: the SFT runs alone, before any service starts (2 cores)."""
    seed: int = 0


@dataclass(frozen=True)
class ToolSft:
    """Teach an environment's call format (module doc)."""

    episodes: EpisodeSettings
    """The environment and the limits its episodes are evaluated under (`producer.episodes`)."""
    traces: float = 0.5
    """Share of the training problems written as worked tool episodes."""

    def inputs(self) -> dict:
        return {"traces": self.traces, "episodes": self.episodes.model_dump(mode="json")}


@dataclass
class SftResult:
    accuracy: float
    steps: int
    seconds: float
    in_band: bool
    history: list[dict] = field(default_factory=list)
    out_dir: str = ""
    reused: bool = False


# ----------------------------------------------------------------- data

def _encode_examples(tok, problems: list[Problem], tool: ToolSft | None = None,
                     seed: int = 0) -> list[tuple[list[int], list[bool]]]:
    """(token ids, loss mask) per problem: prompt + answer + eos with the loss on the
    answer and eos; with `tool`, a seeded share of them as worked tool episodes
    (loss on the model turns and eos only). Text is tokenised as the producer does
    (producer/text_tokens.py): a special token's text in a prompt, an answer or an
    observation stays text, so the warm start learns the sequences RL will train on."""
    rng = random.Random(seed)
    turns_of = _reference_turns(tool)
    out = []
    for pr in problems:
        segments = [(pr.prompt, False)]
        if tool is not None and rng.random() < tool.traces:
            turns = turns_of(pr.prompt)
            if turns is None:
                raise ConfigError(f"{pr.prompt!r} has no worked solution with the {tool.episodes.env} tool; "
                                  "the tool format needs the arithmetic task", key="producer.episodes.env")
            segments += turns
        else:
            segments.append((pr.answer, True))
        ids, mask = [], []
        for text, learn in segments:
            t = encode_text(tok, text)
            ids += t
            mask += [learn] * len(t)
        out.append((ids + [tok.eos_token_id], mask + [True]))
    return out


def _reference_turns(tool: ToolSft | None):
    if tool is None:
        return None

    env_cls = env_factory(tool.episodes)
    if not hasattr(env_cls, "reference_turns"):
        raise ConfigError(f"environment {tool.episodes.env!r} has no reference_turns to teach its format",
                          key="producer.episodes.env")
    return env_cls.reference_turns


def _collate(batch: list[tuple[list[int], list[bool]]], pad_id: int):
    """Right-padded input ids, attention mask and labels (-100 where the loss mask is off, and on padding)."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    x = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (ids, learn) in enumerate(batch):
        t = torch.tensor(ids, dtype=torch.long)
        x[i, :len(ids)] = t
        mask[i, :len(ids)] = 1
        labels[i, :len(ids)] = torch.where(torch.tensor(learn), t, -100)
    return x, mask, labels


def data_digest(*paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------- training

def _lr_at(step: int, cfg: SftConfig) -> float:
    return cfg.lr * min(1.0, (step + 1) / max(cfg.warmup_steps, 1))


def _distance_to_band(acc: float, cfg: SftConfig) -> float:
    return max(cfg.band_low - acc, acc - cfg.band_high, 0.0)


def _band_accuracy(model, tok, heldout: list[Problem], cfg: SftConfig, tool: ToolSft | None) -> float:
    """Greedy held-out accuracy: single-turn, or with the tool when teaching its format."""
    if tool is None:
        return evaluate_model(model, tok, heldout, cfg.max_new_tokens).accuracy

    outs = run_episodes(model, tok, heldout, tool.episodes)
    return sum(o.reward > 0 for o in outs) / max(len(outs), 1)


def train(model, tok, train_problems: list[Problem], heldout: list[Problem], cfg: SftConfig,
          progress=None, tool: ToolSft | None = None) -> SftResult:
    """Fine-tune `model` in place until held-out accuracy is in the band (see module doc)."""
    import torch

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    examples = _encode_examples(tok, train_problems, tool, cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    t0 = time.perf_counter()
    history: list[dict] = []
    best: tuple[float, dict, int] | None = None  # (distance to band, state, step)
    order: list[int] = []
    step, loss_ema = 0, None
    while step < cfg.max_steps:
        model.train()
        if len(order) < cfg.batch_size:
            order = list(range(len(examples)))
            rng.shuffle(order)
        batch = [examples[order.pop()] for _ in range(cfg.batch_size)]
        x, mask, labels = _collate(batch, tok.pad_token_id)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lv = loss.item()
        loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
        if step % cfg.eval_every and step < cfg.max_steps:
            continue
        model.eval()
        acc = _band_accuracy(model, tok, heldout, cfg, tool)
        row = {"step": step, "loss": round(loss_ema, 4), "accuracy": acc,
               "seconds": round(time.perf_counter() - t0, 1)}
        history.append(row)
        (progress or log.info)(f"sft{' (tool format)' if tool else ''} step={step} loss={loss_ema:.3f} "
                               f"heldout_acc={acc:.3f}{' with the tool' if tool else ''} t={row['seconds']:.0f}s")
        d = _distance_to_band(acc, cfg)
        if best is None or d < best[0]:
            best = (d, copy.deepcopy(model.state_dict()), step)
        if d == 0.0 or acc > cfg.band_high:
            break
    assert best is not None
    if best[2] != step:
        log.warning("held-out accuracy jumped over the band; keeping the snapshot of step %d", best[2])
        model.load_state_dict(best[1])
    acc = next(h["accuracy"] for h in history if h["step"] == best[2])
    return SftResult(accuracy=acc, steps=best[2], seconds=time.perf_counter() - t0,
                     in_band=best[0] == 0.0, history=history)


# ----------------------------------------------------------------- entry points

def _marker(cfg: SftConfig, base_dir, train_path, heldout_path, tool: ToolSft | None = None) -> dict:
    spec = Path(base_dir) / "rlstream_tiny_spec.json"
    out = {"sft": asdict(cfg), "data": data_digest(train_path, heldout_path),
           "base_weights": data_digest(Path(base_dir) / "model.safetensors"),
           "spec": json.loads(spec.read_text()) if spec.exists() else None}
    if tool is not None:  # only then: plain warm starts built before keep their marker
        out["tool"] = tool.inputs()
    return out


def load_warm(out_dir, cfg: SftConfig, base_dir, train_path, heldout_path,
              tool: ToolSft | None = None) -> SftResult | None:
    """The saved result if `out_dir` holds a warm model built from exactly these inputs."""
    m = Path(out_dir) / SFT_MARKER
    if not m.is_file() or not (Path(out_dir) / "model.safetensors").is_file():
        return None
    saved = json.loads(m.read_text())
    if saved.get("inputs") != _marker(cfg, base_dir, train_path, heldout_path, tool):
        return None
    res = SftResult(**saved["result"])
    res.reused = True
    return res


def warm_start(base_dir, out_dir, train_path, heldout_path, cfg: SftConfig | None = None,
               reuse: bool = True, progress=None, tool: ToolSft | None = None) -> SftResult:
    """SFT the model in `base_dir` into `out_dir` (HF format); reuse a matching one if allowed.
    With `tool`: teach that environment's call format (module doc)."""
    import torch

    cfg = cfg or SftConfig()
    if reuse and (res := load_warm(out_dir, cfg, base_dir, train_path, heldout_path, tool)) is not None:
        (progress or log.info)(f"sft: reusing warm model {out_dir} (held-out accuracy {res.accuracy:.3f})")
        return res
    torch.set_num_threads(cfg.num_threads)
    model, tok = load_model(base_dir)
    heldout = read_problems(heldout_path, cfg.eval_limit)
    res = train(model, tok, read_problems(train_path), heldout, cfg, progress, tool)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    for name in ("generation_config.json", "rlstream_tiny_spec.json"):
        if (Path(base_dir) / name).exists():
            shutil.copyfile(Path(base_dir) / name, tmp / name)
    res.out_dir = str(out)
    (tmp / SFT_MARKER).write_text(json.dumps(
        {"inputs": _marker(cfg, base_dir, train_path, heldout_path, tool), "result": asdict(res)}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return res


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base_dir")
    p.add_argument("out_dir")
    p.add_argument("train")
    p.add_argument("heldout")
    p.add_argument("--low", type=float, default=SftConfig.band_low)
    p.add_argument("--high", type=float, default=SftConfig.band_high)
    p.add_argument("--max-steps", type=int, default=SftConfig.max_steps)
    p.add_argument("--lr", type=float, default=SftConfig.lr)
    p.add_argument("--threads", type=int, default=SftConfig.num_threads)
    p.add_argument("--no-reuse", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(message)s")
    cfg = SftConfig(band_low=a.low, band_high=a.high, max_steps=a.max_steps, lr=a.lr, num_threads=a.threads)
    res = warm_start(a.base_dir, a.out_dir, a.train, a.heldout, cfg, reuse=not a.no_reuse)
    print(json.dumps({k: v for k, v in asdict(res).items() if k != "history"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
