"""One journal entry: an unfinished episode's state after its last completed turn (or, with
`producer.journal.every_tokens`, in the middle of a long turn: `Snapshot.partial`), as bytes.

Layout (`encode` / `decode`):

    b"RJ1" | u32 header length (little endian) | JSON header | array bytes

The header holds the scalars, the model turns (what a fresh environment is replayed
with) and, per array, its dtype, shape and byte offset in the payload. Arrays travel
as raw bytes (routing rows are the bulk; JSON lists would be ~5x larger and slow).
Anything else is refused with a `JournalError` naming what is wrong: a journal entry
from another version or a torn value must not crash the producer that reads it.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from common.errors import RlstreamError

MAGIC = b"RJ1"
_ARRAYS = ("prompt_ids", "response", "mask", "logprobs", "versions", "routing")


class JournalError(RlstreamError):
    """A journal entry that cannot be decoded (the entry is skipped and counted)."""


@dataclass
class ModelTurnLog:
    """A model turn as its environment saw it: replayed into a fresh environment at resume."""

    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class Snapshot:
    """An unfinished episode, as journaled. `owner` is the producer whose id its record
    carries (the group's copy, consumer/assembler.py) whoever finishes it; `holder` (and
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
        from producer.rollout.trajectory import oldest_model_version

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
                                          "num_experts", "turns", "reward", "claimed_from", "partial")}
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


def held_fields(value: bytes) -> tuple[str, str, float, str]:
    """(holder, incarnation, written_at, claimed_from) of an entry, from its header alone."""
    h, _ = header(value)
    try:
        return str(h["holder"]), str(h["incarnation"]), float(h["written_at"]), str(h.get("claimed_from", ""))
    except Exception as e:  # noqa: BLE001
        raise JournalError(f"malformed journal entry ({type(e).__name__}: {e})"[:200]) from e


def decode(value: bytes) -> Snapshot:
    h, start = header(value)
    try:
        payload = memoryview(value)[start:]
        arrays = {name: _array(payload, *spec) for name, spec in h.pop("arrays").items()}
        turns = [ModelTurnLog(str(t), [int(i) for i in ids], str(f)) for t, ids, f in h.pop("model_turns")]
        ends = {int(p): int(o) for p, o in h.pop("rollout_ends", {}).items()}
        snap = Snapshot(**h, model_turns=turns, routing=arrays.pop("routing", None), rollout_ends=ends, **arrays)
    except JournalError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed header is one refusal with its reason
        raise JournalError(f"malformed journal entry ({type(e).__name__}: {e})"[:200]) from e
    _check(snap)
    return snap


def _array(payload: memoryview, dtype: str, shape: list[int], offset: int) -> np.ndarray:
    dt = np.dtype(dtype)
    count = int(np.prod(shape)) if shape else 1
    if offset < 0 or offset + count * dt.itemsize > len(payload):
        raise JournalError(f"array of {count} x {dt} at byte {offset} runs past the entry's end")
    return np.frombuffer(payload, dtype=dt, count=count, offset=offset).reshape(shape).copy()


def _check(s: Snapshot) -> None:
    n = s.response.size
    if not (s.mask.size == s.logprobs.size == s.versions.size == n):
        raise JournalError(f"entry {s.key}: response {n}, mask {s.mask.size}, log-probs {s.logprobs.size}, "
                           f"versions {s.versions.size} tokens; they must agree")
    if s.mask.dtype != np.bool_ or s.prompt_ids.size == 0:
        raise JournalError(f"entry {s.key}: mask must be bool and the prompt non-empty")
    if not (isinstance(s.partial, int) and 0 <= s.partial <= n and s.mask[n - s.partial:].all()):
        raise JournalError(f"entry {s.key}: a partial turn of {s.partial!r} tokens must be the model's "
                           f"last tokens of the {n} in the response")
