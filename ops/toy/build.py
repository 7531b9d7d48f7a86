"""`rlstream build-model`: the tiny MoE model, its tokenizer and the task data.

Services call `ensure_model(cfg)` and `ensure_data(cfg)` at start: when
`model.build_tiny` is true and `model.path` has no model yet, the tiny
Qwen3-MoE is built there (no downloads); when the prompts file is missing, the
arithmetic task's train and held-out splits are written beside it. A real
checkpoint directory is used as is.

`task_files(cfg)` is what the harness (SFT warm start, held-out evaluation)
reads: those two files for a JSONL source; for a reasoning-gym source
(common/tasks/reasoning_gym.py), its held-out split and one epoch of its training range,
written once under `<demo.work_dir>/data/<dataset>-<digest of the settings>/`
(the producer generates the same items itself).
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from rlstream.common.config import RlstreamConfig
from rlstream.common.errors import ConfigError
from rlstream.common.tasks.arithmetic import Problem, write_problems, write_splits
from rlstream.common.tasks.reasoning_gym import GymTask
from rlstream.toy.tinymodel import build_tiny_model

log = logging.getLogger(__name__)


def ensure_model(cfg: RlstreamConfig) -> Path:
    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        return path
    if not cfg.model.build_tiny:
        raise ConfigError(f"no HF model at {path} (config.json missing) and build_tiny is false", key="model.path")

    log.info("building the tiny MoE model at %s", path)
    return build_tiny_model(path)


def wait_for_model(cfg: RlstreamConfig, timeout_s: float = 300.0) -> Path:
    """Wait until another process (rank 0) has finished `ensure_model`."""
    import time

    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        return path  # already there when we started: a real checkpoint, or a finished build
    done = path / "rlstream_tiny_spec.json"  # the tiny builder writes its marker last
    deadline = time.monotonic() + timeout_s
    while not done.is_file():
        if time.monotonic() > deadline:
            raise ConfigError(f"no model at {path} after {timeout_s:.0f} s", key="model.path")
        time.sleep(0.5)
    return path


def _prompt_file(cfg: RlstreamConfig):
    """The JSONL prompt settings the toy task is written to."""
    if cfg.producer.prompts.type != "jsonl":
        raise ConfigError("the toy task is a JSONL file: set type: jsonl", key="producer.prompts.type")
    return cfg.producer.prompts


def heldout_path(cfg: RlstreamConfig) -> Path:
    return Path(_prompt_file(cfg).path).with_name("heldout.jsonl")


def ensure_data(cfg: RlstreamConfig, n_train: int = 4096, n_heldout: int = 256) -> Path:
    train = Path(_prompt_file(cfg).path)
    if train.is_file():
        return train

    log.info("writing the arithmetic task to %s", train.parent)
    write_splits(train, heldout_path(cfg), n_train=n_train, n_heldout=n_heldout, seed=_prompt_file(cfg).seed)
    return train


def task_files(cfg: RlstreamConfig) -> tuple[Path, Path]:
    """(train, held-out) JSONL files of the configured task, written if missing."""
    p = cfg.producer.prompts
    if p.type != "reasoning_gym":
        return ensure_data(cfg), heldout_path(cfg)

    # the files depend on what fixes the items, not on the shuffle seed or the reward
    digest = hashlib.sha256(json.dumps(p.model_dump(exclude={"seed", "reward"}), sort_keys=True).encode())
    folder = Path(cfg.demo.work_dir) / "data" / f"{p.dataset}-{digest.hexdigest()[:10]}"
    train, heldout = folder / "train.jsonl", folder / "heldout.jsonl"
    if train.is_file() and heldout.is_file():
        return train, heldout
    log.info("writing the reasoning-gym task %s to %s", p.dataset, folder)
    task = GymTask(p)
    split = task.split()
    items = (task.item(i) for i in range(split.train_start, split.train_start + p.size))
    write_problems(train, [Problem(it.prompt, it.answer) for it in items if it.prompt not in split.heldout_prompts])
    write_problems(heldout, [Problem(it.prompt, it.answer) for it in split.heldout])
    return train, heldout


def main(cfg: RlstreamConfig) -> int:
    print(ensure_model(cfg))
    print(*task_files(cfg), sep="\n")
    return 0
