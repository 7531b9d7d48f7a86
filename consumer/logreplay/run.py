"""`rlstream replay`: train a run again from its log and compare it with the original.

    rlstream replay -c run.yaml --out replay/                   # steps 1..N from the model at model.path
    rlstream replay -c run.yaml --from RUN/step-00000010 --out replay/ --to-step 20

The run is `--run-dir` (default: the config's consumer.checkpoint_dir): its
newest checkpoint's lineage says which audit lines made the model
(lineage.py), and each line's `inputs` (record.py) what its step took. For each
step the replay reads those records back by offset (fetch.py), rebuilds the
batch exactly as the live consumer did (the groups in batch order; each
sample's weight from the gate's own code, `gate_group`, under the control
settings recorded for that step and the staleness the gate measured), and
trains it with the consumer's own trainer and rank-0 code (`Leader.train`).
It never waits on generation, never checkpoints on a cadence, publishes no
weights and writes nothing to Kafka.

Compared with the original: every step's metrics (timings left out) as they
serialise to JSON, which is exact for floats, and at the end every tensor of
the model and optimizer state with the original's checkpoint of the last step,
when the run still keeps it. On CPU a replay equals the original bit for bit;
what makes it differ on GPU is docs/log.md. The replayed trainer state is
written to `--out` as a checkpoint directory (not a consumer checkpoint to
resume from: it carries no offsets), with `replay.jsonl`, one line per step.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlstream.common.config import ControlSettings, RlstreamConfig
from rlstream.common.kafka.claimcheck import open_blob_store
from rlstream.consumer.checkpoint.files import (
    STATE,
    TRAINER,
    CheckpointManager,
    CheckpointState,
    rank_shard_name,
)
from rlstream.consumer.logreplay import ReplayError
from rlstream.consumer.logreplay.fetch import StepRecords
from rlstream.consumer.logreplay.lineage import lineage_lines, newest_checkpoint
from rlstream.consumer.logreplay.record import SETTINGS_KEYS, StepInputs, compared_metrics, settings_digest
from rlstream.consumer.ranks.protocol import Leader
from rlstream.consumer.stream.gate import gate_group
from rlstream.consumer.stream.intake import record_limits
from rlstream.consumer.train.parallel import launch_world_size

log = logging.getLogger("rlstream.replay")


@dataclass
class ReplaySummary:
    steps: int = 0
    first_step: int = 0
    last_step: int = 0
    diverged_steps: list[int] = field(default_factory=list)
    params_equal: bool | None = None
    """Every model and optimizer tensor equals the original's checkpoint of the last step
    (None: the run no longer keeps that checkpoint)."""
    differing_tensors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    read_bytes: int = 0

    @property
    def equal(self) -> bool:
        return not self.diverged_steps and self.params_equal is not False

    def as_dict(self) -> dict[str, Any]:
        return {"replay_equal": self.equal, "steps": self.steps, "first_step": self.first_step,
                "last_step": self.last_step, "diverged_steps": self.diverged_steps[:50],
                "params_equal": self.params_equal, "differing_tensors": self.differing_tensors[:50],
                "seconds": round(self.seconds, 3), "steps_per_s": round(self.steps / max(self.seconds, 1e-9), 3),
                "read_bytes": self.read_bytes}


def plan(cfg: RlstreamConfig, run_dir: Path, start: Path | None, to_step: int | None,
         allow_settings: bool = False) -> tuple[int, list[StepInputs]]:
    """(the start step, the inputs of every step to replay), checked against `cfg`."""
    st, _ = newest_checkpoint(run_dir)
    first = 0 if start is None else _start_in_lineage(_state(start), st, start)
    last = st.step if to_step is None else to_step
    lines = lineage_lines(run_dir, st, first, last)
    steps = [StepInputs.parse(lines[s]) for s in range(first + 1, last + 1)]
    want = settings_digest(cfg.consumer)
    other = sorted({s.settings for s in steps} - {want})
    if other and not allow_settings:
        raise ReplayError(f"the run's trainer settings (digest {other[0]}) differ from this config's ({want}) "
                          f"in consumer.{{{', '.join(sorted(SETTINGS_KEYS))}}}: replay with the config "
                          "the run used, or pass --allow-settings-change to train its records under these")
    if any(s.world != 1 for s in steps):
        log.warning("steps trained by several ranks replay in one process: the same global batch, another "
                    "order of the gradient sums, so not bit for bit")
    return first, steps


def _start_in_lineage(start: CheckpointState, st: CheckpointState, path: Path) -> int:
    """The start checkpoint's step, if its model is one the lineage of `st` passed through:
    its own lineage is the runs of `st` that began before its step."""
    if [list(r) for r in start.runs] != [list(r) for r in st.runs if r[1] < start.step]:
        raise ReplayError(f"{path} (step {start.step}, runs {start.runs}) is not in the lineage of the run's "
                          f"newest checkpoint (runs {st.runs}): its incarnation's later steps were lost in a "
                          "crash and redone; start from a checkpoint of the lineage or from step 0")
    return start.step


def replay(cfg: RlstreamConfig, out_dir: Path, run_dir: Path | None = None, start: Path | None = None,
           to_step: int | None = None, allow_settings: bool = False, compare: bool = True) -> ReplaySummary:
    run_dir = Path(run_dir or cfg.consumer.checkpoint_dir)
    out_dir = Path(out_dir)
    if out_dir.resolve() == run_dir.resolve():
        raise ReplayError("--out must not be the run's checkpoint directory: a replay never writes into the run")
    first, steps = plan(cfg, run_dir, start, to_step, allow_settings)
    trainer = _trainer(cfg, start)
    leader = Leader(trainer, CheckpointManager(out_dir, keep=1), cfg.consumer.group_size)
    records = _records(cfg, steps, open_blob_store(cfg.kafka.blob_dir),
                       record_limits(trainer.model.hf_dims, cfg.consumer.group_size))
    summary = ReplaySummary(first_step=first, last_step=first + len(steps))
    t0 = time.perf_counter()
    try:
        with open(out_dir / "replay.jsonl", "w") as lines:
            for s in steps:
                got = compared_metrics(leader.train(samples(s, records.take(s),
                                                            cfg.consumer.stress.logprob_temperature_scale)))
                same = _canonical(got) == _canonical(s.metrics)
                if not same:
                    summary.diverged_steps.append(s.step)
                lines.write(json.dumps({"step": s.step, "equal": same, "metrics": got}) + "\n")
                summary.steps += 1
                log.info("replayed step %d (%s)", s.step, "equal" if same else "DIVERGED")
        summary.seconds = time.perf_counter() - t0
        summary.read_bytes = records.read_bytes
    finally:
        records.close()
    _save(leader, out_dir, steps[-1] if steps else None, first)
    if compare and steps:
        _compare_params(trainer, run_dir, summary)
    return summary


def samples(s: StepInputs, rollouts: list, temperature_scale: float = 1.0) -> list:
    """The step's TrainSamples: its groups in batch order, each sample weighted and aged by the gate
    (consumer/stream/gate.py `gate_group`) under the control settings recorded for the step (its age
    feeds the signals by staleness); `temperature_scale`: `consumer.stress`, as the run trained."""
    from rlstream.consumer.train.batch import TrainSample  # defers torch

    try:
        control = ControlSettings(**s.control)
    except ValueError as e:  # pydantic's ValidationError: a setting this rlstream does not know
        raise ReplayError(f"step {s.step}: recorded control settings {s.control} are not valid here ({e}); "
                          "replay with the rlstream version that wrote the run") from None
    stale = {r.rollout_id: st for r, st in zip(rollouts, s.staleness)}
    out = []
    for group in _groups(s, rollouts):
        d = gate_group(group, 0, control, s.dynamic_sampling, staleness=lambda r: stale[r.rollout_id])
        if not d.keep:
            raise ReplayError(f"step {s.step}: group {group[0].group_id} is {d.outcome} under the recorded "
                              f"settings {s.control} (staleness {d.staleness}); the audit line is inconsistent")
        out += [TrainSample.from_rollout(r, w, a, temperature_scale) for r, w, a in zip(group, d.weights, d.ages)]
    return out


def _groups(s: StepInputs, rollouts: list) -> list[list]:
    groups: list[list] = []
    for r in rollouts:
        if groups and groups[-1][0].group_id == r.group_id:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _trainer(cfg: RlstreamConfig, start: Path | None):
    """The consumer's trainer in a world of one, at `model.path` or the start checkpoint."""
    import torch

    from rlstream.consumer.train.trainer import Trainer  # defers torch

    if launch_world_size() != 1:
        raise ReplayError("rlstream replay runs in one process: start it without torchrun")
    if cfg.consumer.parallel.tensor != 1 or cfg.consumer.parallel.expert != 1:
        raise ReplayError("rlstream replay runs in one process: set consumer.parallel.tensor=1 and expert=1 "
                          "(--set); runs of a tensor- or expert-parallel layout cannot be replayed yet")
    torch.set_num_threads(cfg.consumer.num_threads)  # as the consumer does: CPU sums split by thread
    trainer = Trainer.from_hf(cfg.model.path, cfg.consumer, world_size=1)
    if start is not None:
        trainer.load_state_dict(CheckpointManager.load_trainer_state(Path(start), TRAINER, rank_shard_name(0, 1)))
    return trainer


def _records(cfg: RlstreamConfig, steps: list[StepInputs], blobs, limits):
    return StepRecords(cfg.kafka, steps, blobs, limits)


def _state(path: Path) -> CheckpointState:
    f = Path(path) / STATE
    if not f.is_file():
        raise ReplayError(f"{path} is not a committed checkpoint (no {STATE}); pass a step-NNNNNNNN directory")
    return CheckpointState.from_json(f.read_text())


def _save(leader, out_dir: Path, last: StepInputs | None, first: int) -> None:
    step = last.step if last is not None else first
    leader.ckpt.save(CheckpointState(step=step, version=step, offsets={}), leader.trainer.state_dict())


def _compare_params(trainer, run_dir: Path, summary: ReplaySummary) -> None:
    path = Path(run_dir) / f"step-{summary.last_step:08d}"
    if not (path / STATE).is_file():
        log.info("the run no longer keeps the checkpoint of step %d: parameters not compared", summary.last_step)
        return
    original = CheckpointManager.load_trainer_state(path, TRAINER, rank_shard_name(0, 1))
    mine = trainer.state_dict()
    summary.differing_tensors = [d for k in ("model", "optimizer") for d in _diff(mine[k], original[k], k)]
    summary.params_equal = not summary.differing_tensors


def _diff(a: Any, b: Any, name: str) -> list[str]:
    """Names of the tensors (and values) where `a` and `b` differ, bit for bit."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))
        return [] if same else [name]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{name}: keys {sorted(map(str, set(a) ^ set(b)))[:5]}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{name}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{name}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{name}[{i}]")]
    return [] if _canonical(a) == _canonical(b) else [name]


def _canonical(x: Any) -> str:
    """JSON text: exact for floats (repr round-trips), NaN equal to NaN."""
    return json.dumps(x, sort_keys=True)
