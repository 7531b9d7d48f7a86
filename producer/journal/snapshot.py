"""One journal entry: an unfinished episode's state after its last completed turn (or, with
`producer.journal.every_tokens`, in the middle of a long turn: `Snapshot.partial`), as bytes.

Layout (`encode` / `decode`):

    b"RJ1" | u32 header length (little endian) | JSON header | array bytes

The header holds the scalars, the model turns (what a fresh environment is replayed
with) and, per array, its dtype, shape and byte offset in the payload. Arrays travel
as raw bytes (routing rows are the bulk; JSON lists would be ~5x larger and slow).
Anything else is refused with a `JournalError` naming what is wrong and a reason label
(`JournalError.reason`): a journal entry from another version, a torn value or a hostile
one must not crash the producer that reads it. Two depths: `held` checks the header
fields every reader folds (who holds the entry, when, at which epoch, under which key);
`validate` checks a decoded entry against the record schema's limits (common/record/validation.py)
and the resuming engine's model before it is resumed, so what a resume publishes is
never refused downstream.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import numpy as np

from rlstream.common.errors import InvalidRecordError, RlstreamError
from rlstream.common.record import (
    MAX_CLAIM_EPOCH,
    RecordLimits,
    Rollout,
    routing_dtype_for,
)
from rlstream.common.record import (
    validate as validate_record,
)
from rlstream.producer.journal.claims import Held
from rlstream.producer.rollout.trajectory import oldest_model_version

MAGIC = b"RJ1"
_ARRAYS = ("prompt_ids", "response", "mask", "logprobs", "versions", "routing")
_DTYPES = {"prompt_ids": np.dtype("<i4"), "response": np.dtype("<i4"), "mask": np.dtype(bool),
           "logprobs": np.dtype("<f4"), "versions": np.dtype("<i8")}
MAX_INCARNATION = 64

REASONS = ("key", "lease", "entry", "key_mismatch", "limits", "checkpoint")
"""`JournalError.reason`: the label of `rlstream_producer_journal_refused_total`."""


class JournalError(RlstreamError):
    """A journal record that is refused (skipped and counted by `reason`, one of REASONS;
    an episode's entry is copied to the dead-letter topic with the message)."""

    def __init__(self, message: str, reason: str = "entry"):
        self.reason = reason
        super().__init__(message)


@dataclass
class ModelTurnLog:
    """A model turn as its environment saw it: replayed into a fresh environment at resume."""

    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class Snapshot:
    """An unfinished episode, as journaled. `owner` is the producer whose id its record
    carries (the group's copy, consumer/stream/assembler.py) whoever finishes it; `holder` (and
    its `incarnation`) is the process running it now; `rollout_id` is fixed at the first
    entry, so that two producers finishing one episode publish one rollout id."""

    group_id: str
    sample_idx: int
    group_size: int
    owner: str
    holder: str
    incarnation: str
    rollout_id: str
    written_at: float
    prompt_text: str
    answer: str
    own_score: bool
    """The prompt had its own scorer (not serialisable): the episode cannot be resumed."""
    prompt_ids: np.ndarray
    response: np.ndarray
    mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    routing: np.ndarray | None
    num_experts: int
    turns: int
    reward: float
    partial: int = 0
    """The last `partial` response tokens are a model turn that was still generating
    (producer.journal.every_tokens): not in `model_turns`, not counted in `turns`; the
    resumed episode continues that turn with the rest of its budget."""
    info: dict = field(default_factory=dict)
    model_turns: list[ModelTurnLog] = field(default_factory=list)
    claimed_from: str = ""
    """On a claim: the token of the entry it takes over (claims.py `applies`); else empty."""
    epoch: int = 0
    """The claim epoch `holder` runs the episode under: 0 for its first holder, one more per
    claim (claims.py). The episode's record carries it (`claim_epoch`)."""
    resumed_from: str = ""
    """The token of the entry the claim of this epoch took over (empty at epoch 0): what the
    producer it was taken from had made by then (its generation since is counted wasted)."""
    rollout_ends: dict[int, int] = field(default_factory=dict)
    """{partition: offset} of the rollouts topic, a lower bound taken when the episode's
    holder wrote its last state: the episode's record, published after that, lies at or
    after these offsets (published.py looks there before a resume)."""

    @property
    def key(self) -> str:
        return episode_key(self.group_id, self.sample_idx)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version of a model token, None before the first turn."""
        return oldest_model_version(self.versions, self.mask)


def episode_key(group_id: str, sample_idx: int) -> str:
    return f"ep:{group_id}#{sample_idx}"


def encode(s: Snapshot) -> bytes:
    arrays, specs, offset = [], {}, 0
    for name in _ARRAYS:
        a = getattr(s, name)
        if a is None:
            continue
        a = np.ascontiguousarray(a)
        specs[name] = [a.dtype.str, list(a.shape), offset]
        arrays.append(a.tobytes())
        offset += a.nbytes
    header = {k: getattr(s, k) for k in ("group_id", "sample_idx", "group_size", "owner", "holder", "incarnation",
                                          "rollout_id", "written_at", "prompt_text", "answer", "own_score",
                                          "num_experts", "turns", "reward", "claimed_from", "partial", "epoch",
                                          "resumed_from")}
    header["rollout_ends"] = {str(p): int(o) for p, o in s.rollout_ends.items()}
    header["info"] = {k: v for k, v in s.info.items() if isinstance(v, (str, int, float, bool))}
    header["model_turns"] = [[t.text, list(t.token_ids), t.finish_reason] for t in s.model_turns]
    header["arrays"] = specs
    head = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + b"".join(arrays)


def header(value: bytes) -> tuple[dict, int]:
    """The entry's JSON header and where its arrays start, without reading the arrays: every
    reader folds every entry (topic.py), and needs only who holds it and when."""
    if not isinstance(value, (bytes, bytearray, memoryview)) or bytes(value[:3]) != MAGIC or len(value) < 7:
        raise JournalError("not a journal entry (magic RJ1 missing)")
    (n,) = struct.unpack("<I", bytes(value[3:7]))
    try:
        h = json.loads(bytes(value[7:7 + n]))
    except Exception as e:  # noqa: BLE001 - a malformed header is one refusal with its reason
        raise JournalError(f"malformed journal entry ({type(e).__name__}: {e})"[:200]) from e
    if not isinstance(h, dict):
        raise JournalError("malformed journal entry (its header is not an object)")
    return h, 7 + n


def held(key: str, value: bytes) -> Held:
    """Who holds the entry `value` stored under `key`, from its header alone (refused with a
    JournalError unless its fields have their types and bounds and `key` is its episode's)."""
    h, _ = header(value)
    try:
        holder, incarnation, claimed_from = h["holder"], h["incarnation"], h.get("claimed_from", "")
        resumed_from = h.get("resumed_from", "")
        written_at, epoch = h["written_at"], h.get("epoch", 0)
        group_id, sample_idx = h["group_id"], h["sample_idx"]
    except Exception as e:  # noqa: BLE001 - a header without the fields, or not a map
        raise JournalError(f"malformed journal entry ({type(e).__name__}: {e})"[:200]) from e
    _text("holder", holder, MAX_ID)
    _text("incarnation", incarnation, MAX_INCARNATION)
    _text("claimed_from", claimed_from, 2 * MAX_ID, empty=True)
    _text("resumed_from", resumed_from, 2 * MAX_ID, empty=True)
    _text("group_id", group_id, MAX_ID)
    if not _finite(written_at):
        raise JournalError(f"journal entry {key[:80]!r}: written_at {written_at!r} is not a finite number")
    if not (_int(epoch) and 0 <= epoch <= MAX_CLAIM_EPOCH) or not (_int(sample_idx) and sample_idx >= 0):
        raise JournalError(f"journal entry {key[:80]!r}: epoch {epoch!r} and sample_idx {sample_idx!r} must be "
                           "non-negative integers")
    if episode_key(group_id, sample_idx) != key:
        raise JournalError(f"journal entry under key {key[:80]!r} is episode {episode_key(group_id, sample_idx)[:80]!r}: "
                           "an entry lives under its own episode's key", reason="key_mismatch")
    return Held(key, holder, incarnation, float(written_at), epoch, claimed_from=claimed_from,
                resumed_from=claimed_from or resumed_from)


MAX_ID = RecordLimits().max_id_length


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _text(name: str, v, most: int, empty: bool = False) -> None:
    if not isinstance(v, str) or not (0 if empty else 1) <= len(v) <= most:
        raise JournalError(f"journal entry: {name} must be a string of {0 if empty else 1}..{most} characters, "
                           f"got {type(v).__name__} {str(v)[:40]!r}")


def decode(value: bytes) -> Snapshot:
    """The entry `value`, its fields typed and its arrays consistent (JournalError if not);
    `validate` then checks it against the record schema's limits."""
    h, start = header(value)
    try:
        payload = memoryview(value)[start:]
        specs = h.pop("arrays")
        arrays = {name: _array(payload, name, *specs[name]) for name in _ARRAYS if name in specs}
        turns = [ModelTurnLog(_str(t), [int(i) for i in ids], _str(f)) for t, ids, f in h.pop("model_turns")]
        ends = {int(p): int(o) for p, o in h.pop("rollout_ends", {}).items()}
        snap = Snapshot(**h, model_turns=turns, routing=arrays.pop("routing", None), rollout_ends=ends, **arrays)
    except JournalError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed header is one refusal with its reason
        raise JournalError(f"malformed journal entry ({type(e).__name__}: {e})"[:200]) from e
    _check(snap)
    return snap


def _str(v) -> str:
    if not isinstance(v, str):
        raise JournalError(f"malformed journal entry (a model turn's text is {type(v).__name__}, not a string)")
    return v


def _array(payload: memoryview, name: str, dtype: str, shape: list[int], offset: int) -> np.ndarray:
    dt = np.dtype(dtype)
    want = _DTYPES.get(name)
    if (dt != want) if want is not None else dt not in (np.dtype("<u1"), np.dtype("<u2")):
        raise JournalError(f"array {name} has dtype {dt}, the format's is {want or 'uint8 or uint16'}")
    if not (isinstance(shape, list) and len(shape) == (3 if name == "routing" else 1)
            and all(_int(d) and d >= 0 for d in shape) and _int(offset) and offset >= 0):
        raise JournalError(f"array {name}: shape {str(shape)[:40]} at {offset!r} is not a valid layout")
    count = math.prod(shape)
    if offset + count * dt.itemsize > len(payload):
        raise JournalError(f"array of {count} x {dt} at byte {offset} runs past the entry's end")
    return np.frombuffer(payload, dtype=dt, count=count, offset=offset).reshape(shape).copy()


def _check(s: Snapshot) -> None:
    n = s.response.size
    if not (s.mask.size == s.logprobs.size == s.versions.size == n):
        raise JournalError(f"entry {s.key}: response {n}, mask {s.mask.size}, log-probs {s.logprobs.size}, "
                           f"versions {s.versions.size} tokens; they must agree")
    if s.mask.dtype != np.bool_ or s.prompt_ids.size == 0:
        raise JournalError(f"entry {s.key}: mask must be bool and the prompt non-empty")
    if not (_int(s.partial) and 0 <= s.partial <= n and s.mask[n - s.partial:].all()):
        raise JournalError(f"entry {s.key}: a partial turn of {s.partial!r} tokens must be the model's "
                           f"last tokens of the {n} in the response")


# ------------------------------------------------------------------ limits

def validate(s: Snapshot, limits: RecordLimits) -> None:
    """Refuse (JournalError, reason "limits") an entry whose resumed record the record
    schema would refuse (common/record/validation.py `validate` under `limits`: the resuming engine's
    vocabulary, context and routing shape), or whose fields a resume cannot take."""
    try:
        _scalars(s, limits)
        validate_record(_as_record(s), limits)
        _routing(s, limits)
    except InvalidRecordError as e:
        raise JournalError(f"entry {s.key[:80]}: {e}"[:400], reason="limits") from None
    except JournalError as e:
        raise JournalError(str(e), reason="limits") from None


def _scalars(s: Snapshot, limits: RecordLimits) -> None:
    for name in ("owner", "rollout_id", "group_id", "holder"):
        _text(name, getattr(s, name), limits.max_id_length)
    for name in ("prompt_text", "answer"):
        _text(name, getattr(s, name), limits.max_prompt_tokens * 64, empty=True)
    if not (isinstance(s.own_score, bool) and _int(s.group_size) and _int(s.num_experts) and _int(s.turns)
            and s.turns >= 0 and len(s.model_turns) <= max(s.turns, 0)):
        raise JournalError("own_score, group_size, num_experts and turns must be a bool and integers, "
                           "with no more model turns logged than turns")
    if not _finite(s.reward):
        raise InvalidRecordError("reward", f"must be a finite number, got {s.reward!r}")
    if not isinstance(s.info, dict) or not all(isinstance(k, str) and not (isinstance(v, float) and not _finite(v))
                                               for k, v in s.info.items()):
        raise InvalidRecordError("reward_info", "an entry's info is a map of names to values (numbers finite)")
    if any(p < 0 or o < 0 for p, o in s.rollout_ends.items()):
        raise JournalError("rollout_ends: partitions and offsets are non-negative")
    for t in s.model_turns:
        if any(i < 0 or i > limits.max_token_id for i in t.token_ids):
            raise InvalidRecordError("response_ids", "a logged model turn's token ids must be in [0, max_token_id]")


def _as_record(s: Snapshot) -> Rollout:
    """The record the entry's tokens would make now. An entry journaled before its first
    model turn has no response yet: one model token (id 0) stands in for the turn to come."""
    response, logprobs, mask, versions = s.response, s.logprobs, s.mask, s.versions
    if not response.size:
        response, logprobs = np.zeros(1, np.int32), np.zeros(1, np.float32)
        mask, versions = np.ones(1, bool), np.zeros(1, np.int64)
    starts = np.flatnonzero(np.diff(versions, prepend=versions[0] - 1))
    runs = np.stack([versions[starts], np.diff(np.append(starts, versions.size))], axis=1).astype(np.int64)
    return Rollout(rollout_id=s.rollout_id, group_id=s.group_id, sample_idx=s.sample_idx, group_size=s.group_size,
                   prompt_ids=s.prompt_ids, response_ids=response, logprobs=logprobs,
                   policy_version=int(versions[0]), reward=float(s.reward), producer_id=s.owner,
                   token_versions=runs, loss_mask=None if mask.all() else mask)


def _routing(s: Snapshot, limits: RecordLimits) -> None:
    """Routing rows so far: the record's rules, but rows up to P + T - 1 (the rows of the
    environment's last tokens come with the next turn's prefill)."""
    r = s.routing
    if r is None:
        return
    if not 1 <= s.num_experts <= limits.max_experts or r.dtype != routing_dtype_for(s.num_experts):
        raise InvalidRecordError("num_experts", f"{s.num_experts} experts do not fit routing of dtype {r.dtype}")
    rows, layers, k = r.shape
    if rows > s.prompt_ids.size + s.response.size - 1 or not (1 <= layers <= limits.max_layers
                                                               and 1 <= k <= min(limits.max_top_k, s.num_experts)):
        raise InvalidRecordError("routed_experts", f"shape {r.shape} does not fit P={s.prompt_ids.size}, "
                                 f"T={s.response.size}")
    if r.size and int(r.max()) >= s.num_experts:
        raise InvalidRecordError("routed_experts", f"expert id {int(r.max())} >= num_experts {s.num_experts}")
    for name, want, got in (("layers", limits.model_layers, layers), ("top_k", limits.model_top_k, k),
                            ("num_experts", limits.model_experts, s.num_experts)):
        if want is not None and want != got:
            raise InvalidRecordError("routed_experts", f"{name}={got} does not match this engine's model ({want})")
