"""One error hierarchy for rlstream. Every error says what to do next."""
from __future__ import annotations


class RlstreamError(Exception):
    """Base of every error rlstream raises on purpose."""


class ConfigError(RlstreamError):
    """A configuration file, environment variable or flag is invalid.

    `key` is the dotted path of the offending setting (e.g. "kafka.bootstrap_servers").
    """

    def __init__(self, message: str, key: str | None = None):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class InvalidRecordError(RlstreamError):
    """A rollout record failed decoding or validation.

    `field` names the offending record field ("<bytes>" when the payload could not
    even be parsed). The reader sends such records to the dead-letter topic with
    `str(error)` as the reason; callers never crash on them.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.reason = message
        super().__init__(f"invalid record field {field!r}: {message}")


class BrokerError(RlstreamError):
    """The Kafka broker could not be started, reached or administered."""


class PublishError(RlstreamError):
    """A record could not be delivered to Kafka (after all retries)."""


class WeightStoreError(RlstreamError):
    """A weight version is missing, incomplete, or fails its size/sha256 check."""


class OffsetError(RlstreamError):
    """A start or seek offset cannot be used: it names a partition the reader is
    not assigned (e.g. a checkpoint taken on a topic with other partitions) or
    is negative."""


class AdminApiError(RlstreamError):
    """A service's admin API refused a request (`status` is the HTTP code: 401
    wrong token, 400 bad value) or could not be reached (`status` None)."""

    def __init__(self, message: str, status: int | None = None):
        self.status = status
        super().__init__(message)


class EngineError(RlstreamError):
    """The rollout engine was misused (wrong thread, unknown request, a prompt too
    long for `producer.engine.max_model_len`) or vLLM failed."""


class RoutingCaptureError(RlstreamError):
    """The captured routing rows do not line up with the scheduled tokens.

    Seen when prefix caching, speculative decoding or a compiled (non-eager)
    model hides router calls: disable them, or use the GPU path
    (`producer.engine.routing: native`).
    """


class WeightReloadError(RlstreamError):
    """A verified weight version failed to load and restoring the previous one
    failed too: the engine's weights are inconsistent, so the producer exits and
    its supervisor restarts it on a clean engine."""


class InvalidSampleError(RlstreamError):
    """Training samples cannot make a batch: shapes, incomplete groups, too few
    samples for the mini-batches, routing that does not fit the model.

    A data error, not a configuration error: the records passed the reader's
    validation, so the producer and the trainer disagree (check that both run
    the same model and group size).
    """


class ParallelLayoutError(ConfigError):
    """The model or its tensors do not fit the tensor/expert-parallel layout.

    `key` names the setting to change (e.g. "consumer.parallel.tensor").
    """


class CheckpointError(RlstreamError):
    """A trainer checkpoint is incomplete or does not match this model and
    parallel layout (resume with the layout that wrote it, or move it away)."""


class ModelError(RlstreamError):
    """The HF model directory is not a Qwen3-MoE checkpoint rlstream can train:
    its config.json and weights disagree, or it uses an unsupported feature."""


class RankProtocolError(RlstreamError):
    """A rank received a command it does not know from rank 0 (the ranks run
    different rlstream versions: restart them all from one install)."""


class PipelineError(RlstreamError):
    """A supervised service (ops/harness/supervisor.py) failed to start, died,
    or a wait for it timed out; the message carries the tail of its log."""


class BlobStoreError(RlstreamError):
    """The claim-check blob store (`kafka.blob_dir`) cannot store a blob: a
    symbolic link or a path outside the store sits where a blob directory
    belongs. Remove it; blob directories must be plain directories."""

class VerifierError(RlstreamError):
    """A verifier cannot run at all (e.g. math-verify's worker process does not
    start); a wrong or malformed answer is never an error, it scores 0."""


class AgentRequestError(RlstreamError):
    """A black-box agent's request was refused (producer/rollout/agents/: openai.py, driver.py): `status` is the
    HTTP code (400 bad request, 404 unknown episode, 409 conflicts with the episode's
    state or history, 429 admission holds) and `kind` a short machine-readable type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        self.status, self.kind = status, kind
        super().__init__(message)
class WeightTransferError(RlstreamError):
    """A weight version could not be moved on the collective path: the link to
    the trainer (or to a producer) broke or timed out, or the stream is
    malformed. The served weights stay; the producer catches up from the next
    transfer or the durable store."""


class DigestMismatchError(WeightTransferError):
    """A received weight group or version does not match its digest (or the
    announced one): the version is refused before anything is swapped in, the
    served weights stay, and `rlstream_producer_weight_reload_failures_total`
    rises."""
