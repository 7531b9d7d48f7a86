"""Atomic checkpoints: model, optimizer, version and Kafka offsets together.

    <dir>/step-00000012/trainer.pt    model + the optimizer state every rank holds alike
                                      (torch.save, loaded with weights_only=True: tensors
                                      and plain data); trainer-tp{t}-ep{e}.pt, one per
                                      (tp rank, ep rank) pair, under tensor/expert parallelism
    <dir>/step-00000012/optim-rank00003-of00004.pt
                                      each rank's own optimizer state (its shard of the
                                      distributed optimizer's masters and moments)
    <dir>/step-00000012/state.json    version, offsets, processed rollout ids, counters,
                                      lineage (`runs`)
    <dir>/trained.jsonl               audit log: one line per trained step
    <dir>/versions.jsonl              one line per crash that renumbered versions:
                                      {version, step}: that version is the model of that step

When (a cadence) and how without blocking training (a snapshot written by a
background thread) is consumer/checkpoint/cadence.py; this module is the files.

Under tensor or expert parallelism each (tp rank, ep rank) holds different
weights, so the model (and the optimizer state that is not per rank) is one
shard per pair, `trainer-tp{t}-ep{e}.pt` (`shard_name`), written by one rank of
each pair. The distributed optimizer spreads its fp32 masters and moments over
the data-parallel ranks too: each rank writes its own part to its own file
(`rank_shard_name`), so no rank gathers, holds or writes another's (a gather
to data-parallel rank 0 would block the step and put every expert shard's
state on node 0). Every rank writes into the staging directory rank 0
created; rank 0 commits once every file is there (`begin` / `write_shard` /
`wait_for_shards` / `commit`). A shard
file appears under its name only once it is complete and fsynced, so
`state.json` (and with it the offsets) commits only when every rank's shards
are durable. Checkpoints written before the per-rank files (the gathered
optimizer state inside the pair's file) load as they are (`load_trainer_state`).

Why not megatron-core's dist_checkpointing (`dist_checkpointing.save(...,
async_sharded_save=True)`, the fully-parallel wrapper, `AsyncCallsQueue`)?
Its save validates the sharding with collectives on the default group, and
its async finalisation is another (an all-reduce in `maybe_finalize_async_calls`,
then a barrier before metadata.json): every rank must run those on its main
thread in the same order. Our followers run only what rank 0 sends them
(consumer/ranks/protocol.py), and a checkpoint commits with the Kafka offsets of its
step, by rename, only when every rank's files are durable; the finalisation
would have to be a further command, and the commit would wait for the next
one. What it would save per rank is what we write: Megatron's "dp_reshardable"
form of the distributed optimizer's state (each rank's own buckets, no gather:
consumer/train/optimizer.py), by every rank in parallel, from a host copy, in a
background thread (consumer/checkpoint/cadence.py). Like the gathered form before it,
the files resume the parallel layout that wrote them only.

A checkpoint is written under a temporary name, every file fsynced, the
directory renamed into place and its parent fsynced. A directory without
`state.json` is never considered complete. `latest()` returns the newest
complete one; the newest `keep` are kept.

Offsets are the consumer's commit: Kafka offsets are never committed to the
broker, only here, together with the weights they produced. What the offsets
and `processed` mean is the ledger's (consumer/stream/ledger.py): on restart the
reader seeks to `offsets` and the ledger skips the records in `processed`, so
each record is trained at most once in the lineage of the model it resumes.

Lineage. Each consumer incarnation has a run id; `CheckpointState.runs` lists
[run id, step it resumed at] of every incarnation whose steps made the
checkpointed model, and each audit line names its run. So the audit lines of
the newest checkpoint's lineage are, for each listed run, its lines with
steps above its start and up to the next run's start (the last run's: up to
`step`); lines of steps redone after a crash belong to a run outside it.

Redoing lost steps. The audit lines after the checkpoint's step are the steps
a crash lost (`audit_since`): a restart judges the staleness of the records
they trained at the step they were first gated at (records still held at a
checkpoint that a step lost before it had trained are listed in its
`first_gated`: their audit lines lie before the checkpoint), and `versions.jsonl`
(`note_version`) maps every version to the step whose model it was, so the
versions a crash skips do not age any record (consumer/stream/gate.py, GateClock).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlstream.common.errors import CheckpointError
from rlstream.common.fsutil import commit_dir, fsync_path, staging_dir

STATE = "state.json"
TRAINER = "trainer.pt"
AUDIT = "trained.jsonl"
VERSIONS = "versions.jsonl"
AUDIT_CHUNK = 1 << 20
"""`audit_since` reads the audit log backwards this many bytes at a time."""
SHARD_WAIT_S = 3600.0
"""How long rank 0's commit waits for the other ranks' shard files (a 30B shard
takes minutes to write to shared storage)."""


@dataclass
class CheckpointState:
    step: int
    version: int
    offsets: dict[int, int]  # partition -> next offset to read on restart
    # [partition, offset, rollout_id] of records at or above `offsets` that were
    # already processed (trained, dropped, ...): skipped when re-read.
    processed: list[list] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    # [run id, step it resumed at] of each incarnation in this model's lineage, oldest first
    runs: list[list] = field(default_factory=list)
    # [group_id, owner, outcome] of the consumer's recently closed group ids: a reuse is
    # refused after a restart too (consumer/stream/assembler.py)
    closed_groups: list[list] = field(default_factory=list)
    # rollout_id -> the step it was first gated at, for held records that a step lost at an
    # earlier crash had trained: the gate judges them there (consumer/stream/gate.py, GateClock)
    first_gated: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, text: str) -> "CheckpointState":
        d = json.loads(text)
        d["offsets"] = {int(k): int(v) for k, v in d["offsets"].items()}
        return cls(**d)


def shard_name(tp_rank: int = 0, tp: int = 1, ep_rank: int = 0, ep: int = 1) -> str:
    """File name of the trainer-state shard of (tp_rank, ep_rank)."""
    return TRAINER if tp == ep == 1 else f"trainer-tp{tp_rank}-ep{ep_rank}.pt"


def rank_shard_name(rank: int = 0, world: int = 1) -> str:
    """File name of rank `rank`'s own part of the trainer state (its optimizer shard)."""
    return f"optim-rank{rank:05d}-of{world:05d}.pt"


def all_shard_names(tp: int = 1, ep: int = 1, world: int = 1) -> list[str]:
    """Every file of a complete checkpoint's trainer state: one per pair, one per rank."""
    return [shard_name(t, tp, e, ep) for t in range(tp) for e in range(ep)] +\
        [rank_shard_name(r, world) for r in range(world)]


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, keep: int = 2):
        self.root = Path(root)
        self.keep = max(1, keep)
        self.root.mkdir(parents=True, exist_ok=True)

    def _complete(self) -> list[Path]:
        return sorted(p for p in self.root.glob("step-*") if (p / STATE).is_file())

    def save(self, state: CheckpointState, trainer_state: dict[str, Any]) -> Path:
        """One process, one shard: begin, write_shard, commit."""
        tmp = self.begin(state.step)
        self.write_shard(tmp, TRAINER, trainer_state)
        return self.commit(tmp, state, [TRAINER])

    def begin(self, step: int) -> Path:
        """An empty staging directory for the checkpoint of `step`."""
        return staging_dir(self.root / f"step-{step:08d}")

    @staticmethod
    def write_shard(tmp: Path, name: str, trainer_state: dict[str, Any]) -> None:
        """`trainer_state` as `tmp/name`, which appears only complete and fsynced."""
        import torch

        part = Path(tmp) / f"{name}.part"
        torch.save(trainer_state, part)
        fsync_path(part)
        os.rename(part, Path(tmp) / name)

    @staticmethod
    def wait_for_shards(tmp: Path, shards: list[str], timeout_s: float = SHARD_WAIT_S,
                        poll_s: float = 0.05) -> None:
        """Until every shard file is in `tmp` (other ranks write theirs in their own threads)."""
        deadline = time.monotonic() + timeout_s
        while missing := [n for n in shards if not (Path(tmp) / n).is_file()]:
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint {tmp}: shards {missing} not written after {timeout_s:.0f} s "
                                      "(did a rank fail? is checkpoint_dir shared by every rank?)")
            time.sleep(poll_s)

    def commit(self, tmp: Path, state: CheckpointState, shards: list[str]) -> Path:
        """Write state.json and rename `tmp` into place once every shard is there."""
        missing = [n for n in shards if not (tmp / n).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {tmp} is missing shards {missing}: a rank did not "
                                  "write its shard (is checkpoint_dir shared by every rank?)")
        final = self.root / f"step-{state.step:08d}"
        (tmp / STATE).write_text(json.dumps(asdict(state)))
        commit_dir(tmp, final)
        for old in self._complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stray in self.root.glob(".step-*.tmp-*"):  # left by a crash mid-write
            if stray != tmp:
                shutil.rmtree(stray, ignore_errors=True)
        return final

    def latest(self) -> tuple[CheckpointState, Path] | None:
        done = self._complete()
        if not done:
            return None
        p = done[-1]
        return CheckpointState.from_json((p / STATE).read_text()), p

    @staticmethod
    def load_trainer_state(path: Path, name: str = TRAINER, own: str | None = None) -> dict[str, Any]:
        """This rank's trainer state: its pair's shard `name`, joined with its own
        optimizer shard `own` (`rank_shard_name`) when the checkpoint has per-rank files.
        A checkpoint from before them (the optimizer state gathered inside `name`) has
        none and loads as it is. `own` None: the pair's shard alone (to inspect it)."""
        from rlstream.consumer.train.optimizer import join_rank_state  # defers torch

        state = _load(path, name)
        if own is None:
            return state
        if not (path / own).is_file():
            if any(path.glob("optim-rank*.pt")):  # per-rank files, but not this rank's
                have = sorted(p.name for p in path.glob("optim-rank*.pt"))
                raise CheckpointError(f"{path} has no {own} (it has {have}): the checkpoint was written "
                                      "by another number of ranks; resume with the layout and world "
                                      "size that wrote it or move consumer.checkpoint_dir away")
            return state
        state["optimizer"] = join_rank_state(state["optimizer"], _load(path, own))
        return state

    def note_version(self, version: int, step: int) -> None:
        """Version `version` is the model of step `step`: appended to <root>/versions.jsonl
        (before that version is announced) when a restart renumbers the restored model."""
        _append_line(self.root / VERSIONS, {"version": int(version), "step": int(step)})

    def version_anchors(self) -> list[tuple[int, int]]:
        """Every (version, step) `note_version` wrote, oldest first (a torn last line is skipped)."""
        return [(int(d["version"]), int(d["step"])) for d in _read_lines(self.root / VERSIONS)]

    def audit_since(self, step: int) -> list[dict[str, Any]]:
        """The audit lines written after the last line of a step <= `step` (the step of
        the checkpoint resumed): the steps a crash lost, of every incarnation since.
        Read backwards from the end: the log grows by one line per step for good."""
        path = self.root / AUDIT
        if not path.is_file():
            return []
        out: list[dict[str, Any]] = []
        with open(path, "rb") as f:
            pos, tail = f.seek(0, os.SEEK_END), b""
            while pos > 0:
                n = min(AUDIT_CHUNK, pos)
                pos -= n
                f.seek(pos)
                lines = (f.read(n) + tail).split(b"\n")
                tail = lines.pop(0) if pos > 0 else b""  # maybe the end of a line that starts further back
                for raw in reversed(lines):
                    if (e := _parse(raw)) is None:
                        continue
                    if e["step"] <= step:
                        return out[::-1]
                    out.append(e)
        return out[::-1]

    def audit(self, entry: dict[str, Any]) -> None:
        """Append `entry` to <root>/trained.jsonl: one line per trained step,
        {step, version, trained: [rollout ids], run, inputs}, written when the step
        is trained (before any checkpoint holds it); `inputs` is the step record a
        replay follows (consumer/logreplay/record.py).

        A step whose checkpoint never committed is redone after a restart and
        logged again under the same step number by another run: the lineage
        (module docstring) says which line counts. Operators and tests use it to
        check exactly-once.
        """
        _append_line(self.root / AUDIT, entry)


def _load(path: Path, name: str) -> Any:
    import torch

    if not (path / name).is_file():
        have = sorted(p.name for p in path.glob("*.pt"))
        raise CheckpointError(f"{path} has no {name} (it has {have}): the checkpoint was written "
                              "with another consumer.parallel layout; resume with that layout "
                              "or move consumer.checkpoint_dir away")
    return torch.load(path / name, map_location="cpu", weights_only=True)


def _append_line(path: Path, entry: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _parse(raw: bytes) -> dict[str, Any] | None:
    """One JSON line; None for a blank or torn one (a kill mid-write)."""
    try:
        e = json.loads(raw)
    except ValueError:
        return None
    return e if isinstance(e, dict) and isinstance(e.get("step"), int) else None


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [e for raw in path.read_bytes().split(b"\n") if (e := _parse(raw)) is not None]
