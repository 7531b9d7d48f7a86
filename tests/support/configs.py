"""Small configs for the tiny model, as the fault, fuzz and soak runs use them.

`service_config` fills both the producer and the consumer section (one file
can start either); `write_config` writes it for `Service(command, path, ...)`
(ops/harness/supervisor.py), which adds each incarnation's run file on the
command line. HTTP ports are 0: a service picks a free one and reports it in
its run file.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from rlstream.common.config import ConsumerSettings, KafkaSettings, RlstreamConfig

ADMIN_TOKEN = "rlstream-test-token-7f3a"


def service_config(kafka: KafkaSettings, model_dir, tmp: Path, *, G: int = 4, B: int = 2,
                   staleness: dict | None = None, consumer: dict | None = None,
                   producer: dict | None = None) -> RlstreamConfig:
    """A small config for the tiny model: consumer and producer sections both set."""
    # dynamic sampling off: the producers of these runs serve the untrained tiny model, every
    # reward is 0, and the gate would filter every group (test_consumer_service.py and
    # test_reasoning_gym.py run it on)
    c = {"group_size": G, "groups_per_batch": B, "optimizer": {"lr": 1e-3}, "checkpoint_dir": str(tmp / "ckpt"),
         "weight_store_dir": str(tmp / "weights"), "group_timeout_s": 30.0, "dynamic_sampling": "off",
         "http": {"port": 0, "admin_token": ADMIN_TOKEN}, **(consumer or {})}
    p = {"group_size": G, "max_tokens": 6, "prompts": {"type": "jsonl", "path": str(tmp / "data" / "train.jsonl")},
         "max_groups_in_flight": 8, "http": {"port": 0, "admin_token": ADMIN_TOKEN},
         "engine": {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 64}, **(producer or {})}
    return RlstreamConfig.model_validate({
        "kafka": kafka.model_dump(), "model": {"path": str(model_dir), "build_tiny": False},
        "staleness": {"max_staleness": 1, "mode": "drop", **(staleness or {})},
        "producer": p, "consumer": c})


def trainer_writer(kafka: KafkaSettings):
    """A ControlPlaneWriter that speaks as the trainer of these configs: its announcements and
    control changes are signed with ADMIN_TOKEN, so services started from `service_config`
    (which only apply signed records) take them."""
    from rlstream.common.control.plane import ControlPlaneWriter
    from rlstream.common.control.signing import signing_key

    return ControlPlaneWriter(kafka, signing_key(ADMIN_TOKEN))


def write_config(cfg: RlstreamConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


def ensure_prompts(cfg: RlstreamConfig, n_train: int = 64) -> None:
    """The arithmetic task's files beside `producer.prompts.path` (if missing)."""
    from rlstream.toy.build import ensure_data

    ensure_data(cfg, n_train=n_train, n_heldout=8)


def trainer_settings(loss: str = "minirl", optimizer: str = "adamw", grad_clip: float = 1.0,
                     lr: float = 1e-4, **consumer) -> ConsumerSettings:
    """`consumer` settings as the config file gives them (common/config/consumer.py), for a
    Trainer built in the test's process."""
    return ConsumerSettings(loss={"name": loss}, optimizer={"name": optimizer, "lr": lr, "grad_clip": grad_clip},
                            **consumer)
