"""Typed, validated configuration: one model per service, one YAML file per deployment.

A file in `configs/` has top-level sections; each service reads the shared ones
(`kafka`, `model`, `staleness`) and its own (`broker`, `producer`, `consumer`,
`demo`, `experiment`). Every field has a default, bounds and a docstring; unknown keys and bad
values are refused with a message naming the dotted key.

Precedence (later wins): defaults < YAML file < environment < CLI flags.
- environment: `RLSTREAM__SECTION__KEY=value`, e.g.
  `RLSTREAM__KAFKA__BOOTSTRAP_SERVERS=broker:9092` (values parsed as YAML scalars)
- CLI: `--set section.key=value` (repeatable)

This module imports neither torch, vLLM nor Megatron, so a typo fails in a
second, before any engine starts.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.errors import ConfigError

ENV_PREFIX = "RLSTREAM__"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


# ------------------------------------------------------------------- kafka

class TopicSettings(_Section):
    rollouts: str = "rlstream.rollouts"
    """Rollout records, one message per sample, keyed by group id."""
    policy: str = "rlstream.policy"
    """Weight announcements (version, uri, sha256, bytes)."""
    control: str = "rlstream.control"
    """Runtime control (compacted): max_staleness, mode, decay, pause."""
    dlq: str = "rlstream.dlq"
    """Dead letters: records that failed decoding or validation, with a reason header."""
    stale: str = "rlstream.stale"
    """Optional audit copy of samples dropped as stale."""
    rollouts_partitions: int = Field(4, ge=1, le=1024)
    """Partitions of the rollouts topic (a group stays in one partition)."""
    replication_factor: int = Field(1, ge=1, le=16)
    """Replication of created topics (1 for the embedded broker, 3 on a cluster)."""


class KafkaSettings(_Section):
    bootstrap_servers: str | None = None
    """host:port[,host:port]. Unset: start the embedded (bundled tansu) broker."""
    client_id: str = "rlstream"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Passed through to kafka-python for real clusters."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"] | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True
    topics: TopicSettings = TopicSettings()
    max_message_bytes: int = Field(64 << 20, ge=1 << 20, le=1 << 30)
    """Largest message the topics and clients accept (rollouts carry routing)."""
    claim_check_bytes: int = Field(8 << 20, ge=1024)
    """Records larger than this go through the claim check (blob store + pointer)."""
    blob_dir: str = "runs/blobs"
    """Directory of the claim-check blob store (shared storage on a cluster)."""
    compression: Literal["none", "gzip", "lz4", "zstd"] = "none"
    """Producer compression of rollout batches."""
    publish_buffer_records: int = Field(256, ge=1, le=1_000_000)
    """Records a publisher holds unacknowledged before `publish` blocks (backpressure)."""
    request_timeout_ms: int = Field(30_000, ge=1000)
    retry_backoff_ms: int = Field(200, ge=10)

    @model_validator(mode="after")
    def _claim_fits(self):
        if self.claim_check_bytes > self.max_message_bytes:
            raise ValueError("claim_check_bytes must be <= max_message_bytes")
        if self.security_protocol.startswith("SASL") and self.sasl_mechanism is None:
            raise ValueError("sasl_mechanism is required with a SASL security_protocol")
        return self


class BrokerSettings(_Section):
    host: str = "127.0.0.1"
    """Loopback by default: the embedded broker is for one machine."""
    port: int = Field(9092, ge=0, le=65535)
    """0 picks a free port."""
    storage: str = "memory://tansu/"
    """tansu storage engine URL. The bundled build has memory storage only."""
    start_timeout_s: float = Field(30.0, gt=0)


# ---------------------------------------------------------- shared sections

class ModelSettings(_Section):
    path: str = "runs/tiny-model"
    """HF-format model directory (config.json, safetensors, tokenizer)."""
    build_tiny: bool = True
    """Build the tiny Qwen3-MoE at `path` if it does not exist (no downloads)."""


class StalenessSettings(_Section):
    max_staleness: int = Field(2, ge=0, le=1000)
    """Samples older than this many versions are dropped (and counted)."""
    mode: Literal["drop", "reweight"] = "drop"
    """drop: discard beyond max_staleness. reweight: also scale by decay**staleness."""
    decay: float = Field(1.0, gt=0.0, le=1.0)
    """Per-version sample weight gamma in reweight mode (1.0 = no decay)."""
    audit_stale: bool = False
    """Copy dropped samples to the stale topic for audit."""


class HttpSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    """/metrics, /healthz and the admin API. 0 picks a free port (logged)."""
    admin_token: str | None = None
    """Bearer token of the admin API; env RLSTREAM_ADMIN_TOKEN wins. None: admin off."""


# ------------------------------------------------------------- producer

class EngineSettings(_Section):
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    max_model_len: int = Field(256, ge=16)
    kv_cache_memory_bytes: int = Field(256 << 20, ge=1 << 20)
    """vLLM KV-cache budget; required on CPU (the default would reserve 92% of RAM)."""
    tensor_parallel_size: int = Field(1, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    seed: int = 0
    enforce_eager: bool = True
    quantization: Literal["none", "fp8"] = "none"
    """vLLM online quantization of the served weights (fp8: the paper's FP8-inference stress test; GPU)."""
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """GPU only: share of device memory vLLM may use (kv_cache_memory_bytes wins when set)."""
    max_num_batched_tokens: int | None = Field(None, ge=16)
    """Tokens per engine step (None: vLLM's default)."""


class ProducerSettings(_Section):
    producer_id: str | None = None
    """Defaults to hostname-pid."""
    prompts_path: str = "runs/data/train.jsonl"
    """JSONL with `prompt` and `answer`; cycled over epochs."""
    prompt_topic: str | None = None
    """Read prompts from this Kafka topic instead of the file."""
    seed: int = 0
    group_size: int = Field(8, ge=1, le=1024)
    """G samples per prompt."""
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_groups_in_flight: int = Field(8, ge=1)
    verifier: Literal["exact_match", "math"] = "exact_match"
    engine: EngineSettings = EngineSettings()
    http: HttpSettings = HttpSettings()
    num_threads: int = Field(1, ge=1)
    """torch/OpenMP threads of the engine process."""
    run_file: str | None = None
    """JSON status file (pid, HTTP address; final counters at stop) for supervisors
    and tests (common/runfile.py). None: none is written."""


# ------------------------------------------------------------- consumer

class ConsumerSettings(_Section):
    group_size: int = Field(8, ge=1, le=1024)
    """G: samples per group (must match the producers)."""
    groups_per_batch: int = Field(4, ge=1)
    """B: groups per global batch."""
    num_minibatches: int = Field(1, ge=1)
    """N: updates per global batch (1 = on-policy)."""
    loss: Literal["minirl", "minirl_no_is", "minirl_length_norm", "grpo", "cispo"] = "minirl"
    replay: Literal["none", "R2", "R3"] = "none"
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    eps_low: float = Field(0.2, ge=0)
    eps_high: float = Field(0.27, ge=0)
    is_cap: float = Field(5.0, gt=0)
    """C: truncation of the token IS weight."""
    group_timeout_s: float = Field(120.0, gt=0)
    """An incomplete group older than this is dropped and counted."""
    checkpoint_dir: str = "runs/checkpoints"
    keep_checkpoints: int = Field(2, ge=1)
    weight_store_dir: str = "runs/weights"
    keep_versions: int = Field(3, ge=1)
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many global steps (None: run until stopped)."""
    tensor_parallel_size: int = Field(1, ge=1)
    expert_parallel_size: int = Field(1, ge=1)
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision of parameters and compute (bf16 keeps no fp32 master copy)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    advantage: Literal["auto", "mean", "mean_std"] = "auto"
    """auto: mean-centred for MiniRL/CISPO, mean/std for GRPO (docs/algorithm.md)."""
    http: HttpSettings = HttpSettings()
    num_threads: int = Field(1, ge=1)
    run_file: str | None = None
    """JSON status file (pid, HTTP address; final outcome counters at stop) for
    supervisors and tests (common/runfile.py); written by rank 0. None: none."""


class DemoSettings(_Section):
    """`rlstream demo` and the runs it shares with the experiments (common/harness/)."""

    work_dir: str = "runs/demo"
    """Warm start, and one run directory per run under `runs/` (never reused)."""
    num_producers: int = Field(1, ge=1, le=8)
    target_gain: float = Field(0.15, ge=0)
    """Stop once held-out accuracy rose this much above the warm start."""
    max_minutes: float = Field(15.0, gt=0)
    """Time budget of the RL phase (the demo stops when the target is reached)."""
    reuse_warm_start: bool = True
    """Reuse an SFT warm start built from the same base model and task."""
    sft_band_low: float = Field(0.15, ge=0, le=1)
    """SFT stops once greedy held-out accuracy is inside [low, high] ("a minority")."""
    sft_band_high: float = Field(0.45, ge=0, le=1)
    sft_max_steps: int = Field(4000, ge=1)
    eval_metric: str = Field("avg@8", pattern=r"^(greedy|avg@\d+|pass@\d+)$")
    """Held-out accuracy: greedy, avg@k (mean over k samples, the paper's) or pass@k."""
    eval_every_s: float = Field(15.0, gt=0)
    """Seconds between held-out evaluations of the newest weight version."""
    progress_every_s: float = Field(5.0, gt=0)
    """Seconds between progress lines (one scrape of every service)."""


class ExperimentSettings(_Section):
    """`rlstream experiment NAME` (common/harness/experiments.py). Environment:
    `RLSTREAM__EXPERIMENT__ARMS=sync,async_k2`, `RLSTREAM__EXPERIMENT__ARM_SECONDS=60`,
    `RLSTREAM__EXPERIMENT__REPS=1`."""

    arms: list[str] = []
    """Run only these arms (e.g. to redo some of them); empty: every arm. A
    comma-separated string is accepted."""
    arm_seconds: float | None = Field(None, gt=0)
    """RL seconds per arm; None: the experiment's own (async 240, objectives 90, replay 60)."""
    reps: int | None = Field(None, ge=1)
    """Repetitions per arm, interleaved A B B A; None: the experiment's own (async 2, others 1)."""

    @field_validator("arms", mode="before")
    @classmethod
    def _comma_separated(cls, v):
        return [a.strip() for a in v.split(",") if a.strip()] if isinstance(v, str) else v


class RlstreamConfig(_Section):
    """The whole deployment file. Each service reads its sections."""

    kafka: KafkaSettings = KafkaSettings()
    broker: BrokerSettings = BrokerSettings()
    model: ModelSettings = ModelSettings()
    staleness: StalenessSettings = StalenessSettings()
    producer: ProducerSettings = ProducerSettings()
    consumer: ConsumerSettings = ConsumerSettings()
    demo: DemoSettings = DemoSettings()
    experiment: ExperimentSettings = ExperimentSettings()

    @model_validator(mode="after")
    def _groups_agree(self):
        if self.producer.group_size != self.consumer.group_size:
            raise ValueError(f"producer.group_size ({self.producer.group_size}) != consumer.group_size ({self.consumer.group_size})")
        return self


# ---------------------------------------------------------------- loading

def set_path(tree: dict, dotted: str, value: Any, source: str = "an override") -> None:
    """`tree[a][b][c] = value` for `dotted` "a.b.c", creating sections; the one
    dotted-key setter (env, --set, and the harness's run configs use it)."""
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"empty key in {source}")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{p} is not a section ({source})", key=dotted)
        node = nxt
    node[parts[-1]] = value


def _scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _env_overrides(environ: dict[str, str]) -> list[tuple[str, Any]]:
    out = []
    for name, value in sorted(environ.items()):
        if name.startswith(ENV_PREFIX):
            dotted = name[len(ENV_PREFIX):].lower().replace("__", ".")
            out.append((dotted, _scalar(value)))
    return out


def _format_validation(e: ValidationError) -> ConfigError:
    lines = []
    first_key = None
    for err in e.errors():
        key = ".".join(str(x) for x in err["loc"]) or "<root>"
        first_key = first_key or key
        msg = "unknown key (check spelling; see README 'Configuration')" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{key}: {msg}")
    return ConfigError("invalid configuration:\n  " + "\n  ".join(lines), key=None) if len(lines) > 1 \
        else ConfigError(lines[0].split(": ", 1)[1], key=first_key)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                environ: dict[str, str] | None = None) -> RlstreamConfig:
    """File + env + `--set key=value` overrides -> validated RlstreamConfig.

    Raises ConfigError naming the offending key.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (try configs/tiny-cpu.yaml)")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{p} must hold a mapping of sections")
    for dotted, value in _env_overrides(dict(os.environ if environ is None else environ)):
        set_path(tree, dotted, value, f"environment {ENV_PREFIX}{dotted.upper().replace('.', '__')}")
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        set_path(tree, k.strip(), _scalar(v), "--set")
    try:
        return RlstreamConfig.model_validate(tree)
    except ValidationError as e:
        raise _format_validation(e) from None


def dump_config(cfg: RlstreamConfig) -> str:
    """The resolved config as YAML (for --dry-run). Secrets are masked."""
    data = cfg.model_dump(mode="json")
    for section in ("producer", "consumer"):
        if data[section]["http"].get("admin_token"):
            data[section]["http"]["admin_token"] = "***"
    if data["kafka"].get("sasl_plain_password"):
        data["kafka"]["sasl_plain_password"] = "***"
    return yaml.safe_dump(data, sort_keys=False)
